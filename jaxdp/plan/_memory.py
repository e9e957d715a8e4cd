"""Memory planning: what one data-parallel device holds, and what fits.

Data parallelism replicates the whole training state on every device, so the
per-device memory is the same for any number of devices; only the batch shard
and the all-reduce depend on ``num_devices``. The estimate counts, per device:

- the training state, in bytes per parameter of the dtype policy (the seed's
  table for mixed-precision Adam: 2 weights + 2 gradients + 4 master weights
  + 4 + 4 Adam moments = 16);
- jaxdp's gradient accumulator: the step sums micro-batch gradients in
  ``accum_dtype`` (float32) and all-reduces that sum, 4 bytes per parameter;
- the inputs of the per-device batch (``accum_steps * micro_batch_size`` rows)
  and the activations of one micro-batch;
- at ZeRO stage 3, where the parameters rest split too, what the step holds: at rest
  the split parameters (the float32 master copy under a mixed policy: no second,
  half-precision copy rests) and optimizer state; while a micro-batch runs, its
  gradient blocks, what it gathers (the largest layer of the stack, one at a time by
  :func:`jaxdp.scan_layers`, and the root group: the parameters outside the stack,
  gathered whole for each micro-batch and kept through its backward, both in the
  gather dtype) and their whole gradients before the reduce-scatter, in the
  parameters' dtype.

Sizes are bytes; GB means 10^9 bytes, GiB 2^30.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Literal, NamedTuple

from .._checks import is_integer
from .._stages import STAGE_LAYOUTS, StageLayout, stage_layout


class DtypePolicy(NamedTuple):
    """Bytes per parameter of each part of the training state."""

    weights: int  # the weights forward and backward compute with
    gradients: int  # one micro-batch's gradients
    master: int  # a float32 master copy of the weights (0: none)
    moment: int  # one optimizer moment (Adam has two, SGD momentum one)
    param_dtype: str | None  # jaxdp's compiled step runs this policy with these params
    description: str


DTYPE_POLICIES: dict[str, DtypePolicy] = {
    "mixed-bf16": DtypePolicy(
        2, 2, 4, 4, None, "bf16 weights and gradients, fp32 master weights and moments"
    ),
    "mixed-fp16": DtypePolicy(
        2, 2, 4, 4, None, "fp16 weights and gradients, fp32 master weights and moments"
    ),
    "fp32": DtypePolicy(4, 4, 0, 4, "float32", "fp32 weights, gradients and moments"),
    "bf16": DtypePolicy(2, 2, 0, 2, "bfloat16", "bf16 weights, gradients and moments"),
}
"""The dtype policies ``plan_memory`` knows, by name."""

OPTIMIZER_MOMENTS: dict[str, int] = {"adamw": 2, "sgd-momentum": 1, "sgd": 0}
"""Per-parameter moments each optimizer keeps (AdamW: m and v; SGD momentum: one buffer)."""

ACCUM_BYTES = 4
"""Bytes per parameter of jaxdp's gradient accumulator (``accum_dtype`` float32)."""

GATHER_DTYPES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Stage 3's gather dtypes (``Parallel(gather_dtype=...)``) and their bytes per parameter."""

# Each policy's compute dtype: the dtype stage 3 gathers in without a gather_dtype (a
# mixed policy's float32 master weights gathered in half precision, as FSDP2's
# MixedPrecisionPolicy(param_dtype=bfloat16) does).
_COMPUTE_DTYPE = {
    "mixed-bf16": "bfloat16",
    "mixed-fp16": "float16",
    "fp32": "float32",
    "bf16": "bfloat16",
}

Remat = Literal["dots", "full"]
"""What a stage-3 step keeps of a micro-batch's forward for its backward
(``Parallel.remat``): ``"dots"``, every layer's matrix products' outputs (its activations
but the elementwise work the backward recomputes: ``activation_bytes_per_sample`` as
measured with ``jax.checkpoint_policies.dots_saveable``, or at most what stages 0 to 2
keep); ``"full"``, the layers' inputs (the carries of :func:`jaxdp.scan_layers`) and,
while its backward runs, one layer's activations recomputed. The gathered weights are
gathered again either way."""

STAGE_3_REMAT: Remat = "dots"
"""The step's remat at stage 3 (``Parallel(remat="dots")``, FSDP2's default), which
``plan_memory(remat=None)`` plans for."""

DEFAULT_HEADROOM = 0.15

MAX_COUNT = 2**63 - 1
"""The most rows or parameters a plan takes: XLA's array sizes are 64-bit integers, so a
larger global batch or parameter count cannot be laid out as arrays."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kbit": 10**3 / 8,
    "mbit": 10**6 / 8,
    "gbit": 10**9 / 8,
    "tbit": 10**12 / 8,
}
_SIZE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_bytes(text: str | float, *, name: str = "size") -> float:
    """Bytes from ``80GB`` (10^9), ``80GiB`` (2^30), ``400Gbit``, ``512MiB`` or a number.

    A trailing ``/s`` is accepted (bandwidths). Raises ``ValueError`` naming ``name``.
    """
    if isinstance(text, int | float):
        value = float(text)
    else:
        match = _SIZE.match(str(text).removesuffix("/s"))
        unit = match.group(2).lower() if match else None
        if unit not in _UNITS:
            raise ValueError(
                f"{name}={text!r} is not a size: give bytes (80000000000) or a number "
                "with a unit (80GB = 80*10^9 bytes, 80GiB = 80*2^30, 512MiB, 400Gbit)"
            )
        value = float(match.group(1)) * _UNITS[unit]
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{name}={text!r} must be a positive size")
    return value


def parse_count(text: str | float, *, name: str = "params") -> int:
    """A count from ``7e9``, ``7B``, ``125M``, ``350k`` or a number."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        match = _SIZE.match(str(text))
        suffix = match.group(2).lower() if match else None
        if suffix not in _COUNT_SUFFIX:
            raise ValueError(f"{name}={text!r} is not a number: give 7e9, 7B, 125M or 350k")
        value = float(match.group(1)) * _COUNT_SUFFIX[suffix]
    if not value >= 1 or math.isinf(value):
        raise ValueError(f"{name}={text!r} must be a positive count")
    _check_count(name, text, int(round(value)))
    return int(round(value))


def _check_count(name: str, text: object, value: int) -> None:
    if value > MAX_COUNT:
        raise ValueError(
            f"{name}={text!r} exceeds 2**63 - 1 = {MAX_COUNT:,}: XLA's array sizes are "
            "64-bit integers, so no step holds that many"
        )


def ring_all_reduce_bytes(payload_bytes: float, num_devices: int) -> float:
    """Bytes each device sends in a ring all-reduce of ``payload_bytes``: 2(N-1)/N times it.

    A ring all-reduce is a reduce-scatter then an all-gather, each moving
    ``(N-1)/N`` of the payload through every device's link (it receives as much).
    """
    if not is_integer(num_devices) or num_devices < 1:
        raise ValueError(f"num_devices={num_devices!r} must be a positive integer")
    return 2 * (num_devices - 1) / num_devices * payload_bytes


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device memory of a data-parallel step and what fits; bytes throughout.

    Without ``device_memory`` the per-device figures are there, but nothing is
    decided: ``usable`` and ``fits_state`` are None and no micro-batch is chosen.
    At stage 3 the rows are what the compiled step holds: :attr:`resting` between steps
    (the step's arguments but the batch), and while a micro-batch runs its gradient
    blocks, the accumulator, :attr:`gathered` and :attr:`gathered_gradients`.
    """

    params: int
    policy: str
    optimizer: str
    num_devices: int
    device_memory: float | None  # None: not given
    headroom: float  # fraction of device_memory kept free
    weights: float  # at rest; stage 3 under a mixed policy: 0 (the master rests alone)
    gradients: float  # one micro-batch's; stage 3: its blocks, in the parameters' dtype
    master: float
    optimizer_state: float
    accumulator: float  # jaxdp's float32 gradient sum (the all-reduce buffer)
    activation_bytes_per_sample: float | None  # kept for the backward, at this stage's remat
    input_bytes_per_sample: float
    max_micro_batch_size: int | None  # memory's limit; None: undecided; 0: none fits
    global_batch_size: int | None
    micro_batch_size: int | None  # chosen; None when nothing fits or unknown
    accum_steps: int | None
    allreduce_bytes: float  # payload of the gradient sums' collective per optimizer step
    link_bandwidth: float | None  # bytes/s each device sends at
    # 1: master weights and moments split over the devices; 2: accumulator too; 3: the
    # parameters too (only they rest), gradients per micro-batch
    zero_stage: int = 0
    # ZeRO: the all-gathers' payload per optimizer step (stage 3: per micro-batch)
    gather_bytes: float = 0.0
    layers: int | None = None  # stage 3: layers of the stack; None: not given
    root_params: int = 0  # stage 3: parameters outside the stack, gathered whole
    # Stage 3's transients, per micro-batch (counted at stage 3; at the others, for the
    # fewest devices stage 3 needs): one layer's weights in the gather dtype (None: layers
    # unknown) and the root group's; their whole gradients before the reduce-scatter, in
    # the parameters' dtype.
    gathered_layer: float | None = None
    root_group: float = 0.0
    layer_gradient: float | None = None
    root_gradient: float = 0.0
    shards: int | None = None  # stage 3: HSDP's devices per shard group; None: all of them
    gather_dtype: str | None = None  # stage 3: what the weights travel and compute in
    remat: Remat | None = None  # stage 3: what a micro-batch keeps for its backward
    # Stage 3: the parameters as the state holds them over the shard group, the leaves no
    # dimension of which it divides padded (from the model's leaves); None: ``params``.
    padded_params: int | None = None

    @property
    def _layout(self) -> StageLayout:
        """What the stage splits, as the step reads it (:mod:`jaxdp._stages`)."""
        return stage_layout(self.zero_stage)

    @property
    def split_over(self) -> int:
        """The devices the split state is split over: a shard group's (HSDP) or all."""
        return self.shards or self.num_devices

    @property
    def gathered(self) -> float:
        """Stage 3's gathered weights at the peak: one layer (where ``layers`` is known)
        and the root group; 0 below stage 3."""
        if not self._layout.params_split:
            return 0.0
        return (self.gathered_layer or 0.0) + self.root_group

    @property
    def gathered_gradients(self) -> float:
        """Stage 3: the gathered layer's and the root group's whole gradients, before
        their reduce-scatters; 0 below stage 3."""
        if not self._layout.params_split:
            return 0.0
        return (self.layer_gradient or 0.0) + self.root_gradient

    @property
    def resting(self) -> float:
        """What rests between optimizer steps: weights, master weights and optimizer state
        (the compiled step's arguments but the batch and the step's scalars; on the
        multisteps path the accumulator rests too)."""
        return self.weights + self.master + self.optimizer_state

    @property
    def state(self) -> float:
        """Weights + gradients + master weights + optimizer state (the seed's table; at
        stage 3 :attr:`resting` and one micro-batch's gradient blocks)."""
        return self.resting + self.gradients

    @property
    def fixed(self) -> float:
        """Everything that does not grow with the batch: state and accumulator, and at
        stage 3 the gathered layer, the root group and their gradients."""
        return self.state + self.accumulator + self.gathered + self.gathered_gradients

    @property
    def usable(self) -> float | None:
        if self.device_memory is None:
            return None
        return self.device_memory * (1.0 - self.headroom)

    @property
    def fits_state(self) -> bool | None:
        """Whether state and accumulator fit; None without ``device_memory``."""
        usable = self.usable
        return None if usable is None else self.fixed <= usable

    @property
    def inputs(self) -> float:
        """Input bytes of the per-device batch the chosen step takes."""
        return (self.accum_steps or 0) * (self.micro_batch_size or 0) * self.input_bytes_per_sample

    @property
    def activations(self) -> float:
        return (self.micro_batch_size or 0) * (self.activation_bytes_per_sample or 0.0)

    @property
    def total(self) -> float:
        return self.fixed + self.inputs + self.activations

    @property
    def replica_bytes(self) -> float:
        """HSDP: what each device sends per optimizer step in the all-reduce of its block
        of the gradient sums across the ``num_devices / shards`` replica groups; 0 else."""
        if not self._layout.params_split or self.split_over == self.num_devices:
            return 0.0
        groups = self.num_devices // self.split_over
        return ring_all_reduce_bytes(self.allreduce_bytes / self.split_over, groups)

    @property
    def ring_bytes(self) -> float:
        """What each device sends per optimizer step under ring algorithms: one all-reduce
        (stage 0); a reduce-scatter and an all-gather (stage 1); ``accum_steps``
        reduce-scatters and an all-gather (stage 2); per micro-batch the gathers of the
        forward and backward and the reduce-scatters of every layer, within a shard
        group, and under HSDP :attr:`replica_bytes` once (stage 3)."""
        layout = self._layout
        if not layout.state_split:
            return ring_all_reduce_bytes(self.allreduce_bytes, self.num_devices)
        k = self.accum_steps or 1
        share = (self.split_over - 1) / self.split_over
        if layout.params_split:  # every collective once per micro-batch
            return share * k * (self.allreduce_bytes + self.gather_bytes) + self.replica_bytes
        scatters = k if layout.window_split else 1
        return share * (scatters * self.allreduce_bytes + self.gather_bytes)

    @property
    def allreduce_seconds(self) -> float | None:
        if self.link_bandwidth is None:
            return None
        return self.ring_bytes / self.link_bandwidth


def plan_memory(
    *,
    params: int,
    device_memory: float | str | None = None,
    policy: str = "mixed-bf16",
    optimizer: str = "adamw",
    num_devices: int = 1,
    global_batch_size: int | None = None,
    activation_bytes_per_sample: float | None = None,
    input_bytes_per_sample: float = 0.0,
    headroom: float = DEFAULT_HEADROOM,
    link_bandwidth: float | str | None = None,
    zero_stage: int = 0,
    comm_dtype: str | None = None,
    layers: int | None = None,
    root_params: float = 0,
    shards: int | None = None,
    gather_dtype: str | None = None,
    remat: Remat | None = None,
    layer_activation_bytes_per_sample: float | None = None,
    carry_bytes_per_sample: float | None = None,
    padded_params: int | None = None,
) -> MemoryPlan:
    """Estimates one device's memory for data-parallel training with accumulation.

    Args:
      params: parameter count.
      device_memory: bytes per device, or a size such as ``"80GB"`` or ``"80GiB"``;
        None: the per-device figures only (nothing fits or not, no micro-batch).
      policy: a key of :data:`DTYPE_POLICIES`.
      optimizer: a key of :data:`OPTIMIZER_MOMENTS`; moments take the policy's
        ``moment`` bytes each.
      num_devices: data-parallel devices (each holds the whole state).
      global_batch_size: target rows per optimizer step; the plan picks the
        largest micro-batch that fits and divides ``global_batch_size /
        num_devices``, and ``accum_steps`` completes the product.
      activation_bytes_per_sample: activation bytes one sample of a micro-batch
        keeps for the backward pass; None: unknown (no micro-batch is sized). At stage 3
        with ``remat="full"`` and the two figures below, the bytes with every layer's
        activations kept (as at stages 0 to 2), from which the plan derives what full
        remat keeps; without them it is taken as given.
      input_bytes_per_sample: bytes of one input row (the step holds the whole
        per-device batch of ``accum_steps * micro_batch_size`` rows).
      headroom: fraction of ``device_memory`` kept free (allocator slack,
        fragmentation, the runtime's own buffers).
      link_bandwidth: bytes/s each device sends at (or a size such as
        ``"450GB/s"``), for the predicted all-reduce time.
      zero_stage: 1 splits the master weights and the optimizer moments over
        the devices (``/ num_devices``), 2 the float32 gradient accumulator too
        (:func:`jaxdp.make_train_step`'s ``zero_stage``); weights and one
        micro-batch's gradients stay whole. 3 splits the parameters too: only they rest
        (under a mixed policy the float32 master weights, gathered in ``gather_dtype``:
        no half-precision copy rests), with the optimizer state; a micro-batch's
        gradients are blocks in the parameters' dtype, and the step holds what it
        gathers and its whole gradient (``layers``, ``root_params``). Every leaf is
        split, a leaf no dimension of which the shard group's devices divide padded to a
        multiple of them, as the step pads it: counted padded where ``padded_params``
        says how many that makes (``jaxdp plan --model`` counts them from the model's
        leaves), else taken as dividing.
      comm_dtype: ``"bfloat16"``: the gradient sums travel in 2 bytes/parameter.
      layers: the identical layers of the stack :func:`jaxdp.scan_layers` loops over;
        at stage 3 one of ``(params - root_params) / layers`` parameters is gathered at
        a time (counted at stage 3, and in the fewest devices stage 3 needs). None:
        unknown (the gathered layer is not counted).
      root_params: stage 3: parameters outside the stack (embeddings, head, final
        norm), gathered whole for each micro-batch and kept through its backward.
      shards: stage 3: HSDP (``Parallel(shards=S)``): the state split over the ``S``
        devices of a shard group (at least 2, dividing ``num_devices``), the gathers and
        reduce-scatters within it, and once per optimizer step an all-reduce of each
        device's block across the ``num_devices / S`` replica groups. None: one group.
      gather_dtype: stage 3: the dtype the weights are gathered and computed in
        (``Parallel(gather_dtype=...)``), a key of :data:`GATHER_DTYPES`; None: the
        policy's (a mixed policy's half precision, else the parameters' own).
      remat: stage 3: a :data:`Remat`; None: the step's (:data:`STAGE_3_REMAT`).
      layer_activation_bytes_per_sample: one layer of the stack's share of
        ``activation_bytes_per_sample``; with ``carry_bytes_per_sample`` (one layer's
        input per sample), full remat keeps ``activation_bytes_per_sample - (layers - 1)
        * layer + layers * carry``: every layer's input and one layer's activations, as
        its backward recomputes them, beside the root group's activations.
      carry_bytes_per_sample: see ``layer_activation_bytes_per_sample``.
      padded_params: stage 3: the parameter count with every leaf padded as the step's
        state holds it over ``shards`` (or ``num_devices``) devices (``jaxdp plan
        --model`` counts it from the model's leaves); what rests and what the
        reduce-scatters carry is counted from it. None: ``params`` (every leaf taken as dividing).

    Raises:
      ValueError: naming the argument, its value and the rule it breaks.
    """
    params = parse_count(params, name="params")
    if device_memory is not None:
        device_memory = parse_bytes(device_memory, name="device_memory")
    if link_bandwidth is not None:
        link_bandwidth = parse_bytes(link_bandwidth, name="link_bandwidth")
    _check_choice("policy", policy, DTYPE_POLICIES)
    _check_choice("optimizer", optimizer, OPTIMIZER_MOMENTS)
    if not is_integer(num_devices) or num_devices < 1:
        raise ValueError(f"num_devices={num_devices!r} must be a positive integer")
    num_devices = int(num_devices)
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom={headroom!r} must be a fraction in [0, 1)")
    if not is_integer(zero_stage) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    zero_stage = int(zero_stage)
    layout = stage_layout(zero_stage)
    if layers is not None and (not is_integer(layers) or layers < 1):
        raise ValueError(f"layers={layers!r} must be a positive integer")
    if not (isinstance(root_params, int | float) and 0 <= root_params < params):
        raise ValueError(
            f"root_params={root_params!r} must be a count in [0, params={params:,}): the "
            "parameters outside the stack of layers"
        )
    root_params = int(round(root_params))
    if comm_dtype not in (None, "bfloat16"):
        raise ValueError(f"comm_dtype={comm_dtype!r} must be None or 'bfloat16'")
    check_stage_3(zero_stage, num_devices, shards=shards, gather_dtype=gather_dtype, remat=remat)
    shards = None if shards is None else int(shards)
    for name, value in (
        ("activation_bytes_per_sample", activation_bytes_per_sample),
        ("input_bytes_per_sample", input_bytes_per_sample),
        ("layer_activation_bytes_per_sample", layer_activation_bytes_per_sample),
        ("carry_bytes_per_sample", carry_bytes_per_sample),
    ):
        if value is not None and not value >= 0:
            raise ValueError(f"{name}={value!r} must be a non-negative number of bytes")
    _check_layer_activations(
        activation_bytes_per_sample,
        layers,
        layer_activation_bytes_per_sample,
        carry_bytes_per_sample,
    )
    if global_batch_size is not None and (
        not is_integer(global_batch_size)
        or global_batch_size < num_devices
        or global_batch_size % num_devices
    ):
        raise ValueError(
            f"global_batch_size={global_batch_size!r} is not reachable with num_devices="
            f"{num_devices}: global_batch_size = num_devices * accum_steps * "
            "micro_batch_size must be a positive multiple of num_devices"
        )
    if global_batch_size is not None:
        global_batch_size = int(global_batch_size)
        _check_count("global_batch_size", global_batch_size, global_batch_size)
    if padded_params is not None and (not is_integer(padded_params) or padded_params < params):
        raise ValueError(
            f"padded_params={padded_params!r} must be a count of at least params={params:,} "
            "(the parameters with the leaves stage 3 pads padded)"
        )
    p = DTYPE_POLICIES[policy]
    split_over = (shards or num_devices) if layout.params_split else num_devices
    weights, gradients, master, moments, accumulator = _shares(p, optimizer, layout, split_over)
    # Stage 3 holds and reduce-scatters the padded leaves (zeros to a multiple of the
    # shard group); the other stages keep a leaf that does not divide whole.
    held = int(padded_params) if layout.params_split and padded_params is not None else params
    # What stage 3 gathers, in the gather dtype, and the gradient of it before the
    # reduce-scatter, in the parameters' (counted at stage 3; at the others, for the
    # fewest devices stage 3 needs).
    gather = GATHER_DTYPES[gather_dtype or _COMPUTE_DTYPE[policy]]
    resting = p.master or p.weights
    gathered_layer = layer_gradient = None
    if layers is not None:
        gathered_layer = (params - root_params) / layers * gather
        layer_gradient = (params - root_params) / layers * resting
    wire = 2 if comm_dtype else ACCUM_BYTES
    gather_bytes = params * p.weights if layout.state_split else 0.0
    if layout.params_split:
        # Per micro-batch: each layer gathered in the forward and again in the backward
        # (no gathered weight is kept for it, whatever the remat), the root group once;
        # the gradients reduce-scattered in the parameters' dtype (or comm_dtype).
        gather_bytes = (2 * (params - root_params) + root_params) * gather
        wire = 2 if comm_dtype else resting
    per_sample = activation_bytes_per_sample
    if layout.params_split:
        remat = remat or STAGE_3_REMAT
    layer, carry = layer_activation_bytes_per_sample, carry_bytes_per_sample
    if remat == "full" and per_sample is not None and layer is not None:
        assert layers is not None and carry is not None  # _check_layer_activations
        per_sample = per_sample - (layers - 1) * layer + layers * carry

    plan = MemoryPlan(
        params=params,
        policy=policy,
        optimizer=optimizer,
        num_devices=num_devices,
        device_memory=device_memory,
        headroom=headroom,
        weights=held * weights,
        gradients=held * gradients,
        master=held * master,
        optimizer_state=held * moments,
        accumulator=held * accumulator,
        activation_bytes_per_sample=per_sample,
        input_bytes_per_sample=input_bytes_per_sample,
        max_micro_batch_size=None,
        global_batch_size=global_batch_size,
        micro_batch_size=None,
        accum_steps=None,
        allreduce_bytes=held * wire,
        link_bandwidth=link_bandwidth,
        zero_stage=zero_stage,
        gather_bytes=gather_bytes,
        layers=layers,
        root_params=root_params,
        gathered_layer=gathered_layer,
        root_group=root_params * gather,
        layer_gradient=layer_gradient,
        root_gradient=root_params * resting,
        shards=shards if layout.params_split else None,
        gather_dtype=(gather_dtype or _COMPUTE_DTYPE[policy]) if layout.params_split else None,
        remat=remat,
        padded_params=int(padded_params) if layout.params_split and padded_params else None,
    )
    return _size_batches(plan)


def _shares(
    p: DtypePolicy, optimizer: str, layout: StageLayout, num_devices: int
) -> tuple[float, float, float, float, float]:
    """Bytes per parameter on one device at a stage's ``layout``, what it splits split
    over ``num_devices``: weights, gradients, master weights, optimizer state,
    accumulator."""
    moments = p.moment * OPTIMIZER_MOMENTS[optimizer]
    n = num_devices
    if layout.params_split:
        # Only the split parameters rest: under a mixed policy the float32 master, the
        # weights in half precision existing gathered only. A micro-batch's gradients
        # come back as blocks in the parameters' dtype (the master's).
        resting = p.master or p.weights
        weights = 0 if p.master else p.weights
        return weights / n, resting / n, p.master / n, moments / n, ACCUM_BYTES / n
    accumulator = ACCUM_BYTES / n if layout.window_split else ACCUM_BYTES
    if layout.state_split:
        return p.weights, p.gradients, p.master / n, moments / n, accumulator
    return p.weights, p.gradients, p.master, moments, ACCUM_BYTES


def fixed_bytes(
    params: int,
    policy: str,
    optimizer: str,
    num_devices: int,
    layout: StageLayout,
    gathered: float = 0.0,
) -> float:
    """Training state and accumulator per device, at a stage's ``layout`` on
    ``num_devices``; stage 3 adds ``gathered`` (its gathered layer and root group and
    their gradients, the same on any count)."""
    p = DTYPE_POLICIES[policy]
    if layout.params_split:
        return params * sum(_shares(p, optimizer, layout, num_devices)) + gathered
    parts = [
        (p.master + p.moment * OPTIMIZER_MOMENTS[optimizer], layout.state_split),
        (ACCUM_BYTES, layout.window_split),
        (p.weights + p.gradients, layout.params_split),
    ]
    whole = 0.0
    for part, split in parts:
        whole += part / num_devices if split else part
    return params * whole


def smallest_fit(plan: MemoryPlan, *, max_devices: int = 4096) -> dict[int, int | None]:
    """Per ZeRO stage, the fewest devices on which state and accumulator fit the usable
    memory (before the batch; at stage 3 with ``plan``'s gathered layer and root group,
    where known); None where no count does (stage 0: the same on any)."""
    assert plan.usable is not None
    found: dict[int, int | None] = {}
    for layout in STAGE_LAYOUTS:
        n = 1
        while n <= max_devices:
            gathered = (plan.gathered_layer or 0.0) + plan.root_group
            gathered += (plan.layer_gradient or 0.0) + plan.root_gradient
            need = fixed_bytes(plan.params, plan.policy, plan.optimizer, n, layout, gathered)
            if need <= plan.usable:
                break
            n = n + 1 if layout.state_split else max_devices + 1
        found[layout.zero_stage] = n if n <= max_devices else None
    return found


def check_stage_3(
    zero_stage: int,
    num_devices: int,
    *,
    shards: int | None = None,
    gather_dtype: str | None = None,
    remat: str | None = None,
) -> None:
    """Raises ``ValueError`` for stage 3's options (HSDP's ``shards``, ``gather_dtype``,
    ``remat``) where they are not ones, or given below stage 3, as
    :class:`jaxdp.Parallel` refuses them; cheap, so a command checks them first."""
    if shards is not None and (not is_integer(shards) or shards < 2):
        raise ValueError(
            f"shards={shards!r} must be None (one shard group of every device) or an "
            "integer of at least 2 (devices per shard group); shards=1 would keep a whole "
            "copy on every device: that is zero_stage=0 (DDP)"
        )
    whole = is_integer(num_devices) and num_devices >= 1  # else plan_memory says so
    if shards is not None and whole and num_devices % shards:
        raise ValueError(
            f"shards={shards} must divide num_devices={num_devices}: HSDP runs "
            "num_devices / shards replica groups of shards devices each"
        )
    if gather_dtype is not None and gather_dtype not in GATHER_DTYPES:
        raise ValueError(
            f"gather_dtype={gather_dtype!r} must be None (the policy's compute dtype) or "
            f"one of {list(GATHER_DTYPES)}"
        )
    if remat is not None and remat not in ("dots", "full"):
        raise ValueError(f"remat={remat!r} must be None (the step's), 'dots' or 'full'")
    given = [
        f"{name}={value!r}"
        for name, value in (("shards", shards), ("gather_dtype", gather_dtype), ("remat", remat))
        if value is not None
    ]
    if given and zero_stage != 3:
        raise ValueError(
            f"{', '.join(given)} needs zero_stage=3 (the parameters split at rest), got "
            f"zero_stage={zero_stage}: stages 0 to 2 keep every parameter whole on every "
            "device, gather nothing and keep every layer's activations"
        )


def _check_layer_activations(
    total: float | None, layers: int | None, layer: float | None, carry: float | None
) -> None:
    """Full remat's figures: both or neither, with the total and ``layers`` they split."""
    if layer is None and carry is None:
        return
    if layer is None or carry is None or total is None or layers is None:
        raise ValueError(
            f"layer_activation_bytes_per_sample={layer!r} and carry_bytes_per_sample="
            f"{carry!r} go together, with activation_bytes_per_sample={total!r} and "
            f"layers={layers!r}: full remat keeps the root group's activations, every "
            "layer's input and one layer's activations"
        )
    if layers * layer > total:
        raise ValueError(
            f"layers x layer_activation_bytes_per_sample = {layers} x {layer!r} exceeds "
            f"activation_bytes_per_sample={total!r}, of which the stack's layers are a part"
        )


def _check_choice(name: str, value: str, choices: dict) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {sorted(choices)}")


def _size_batches(plan: MemoryPlan) -> MemoryPlan:
    """Fills in the largest micro-batch that fits and the accumulation that reaches the target."""
    act, usable = plan.activation_bytes_per_sample, plan.usable
    if act is None or usable is None:
        return plan
    room = usable - plan.fixed
    if plan.global_batch_size is None:
        # One micro-batch per step: the batch holds micro_batch_size input rows.
        per_sample = act + plan.input_bytes_per_sample
        largest = _floor_div(room, per_sample)
        chosen = largest if largest >= 1 else None
        return dataclasses.replace(
            plan,
            max_micro_batch_size=max(largest, 0),
            micro_batch_size=chosen,
            accum_steps=1 if chosen else None,
            global_batch_size=chosen * plan.num_devices if chosen else None,
        )
    # The fused step holds the whole per-device batch's inputs, whatever the split.
    per_device = plan.global_batch_size // plan.num_devices
    largest = _floor_div(room - per_device * plan.input_bytes_per_sample, act)
    chosen = largest_divisor_at_most(per_device, largest)
    return dataclasses.replace(
        plan,
        max_micro_batch_size=max(largest, 0),
        micro_batch_size=chosen,
        accum_steps=per_device // chosen if chosen else None,
    )


def _floor_div(room: float, per_sample: float) -> int:
    if per_sample <= 0:
        # Nothing grows with the batch: any size fits while the fixed part does.
        return 2**31 - 1 if room >= 0 else 0
    rows = room / per_sample  # inf for a tiny per_sample: more rows than any step holds
    return min(math.floor(rows), MAX_COUNT) if rows < MAX_COUNT else MAX_COUNT


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` (at most 2**63 - 1), ascending.

    From ``n``'s prime factors, not by trial division up to sqrt(n) (which took 34 s at
    10**18): Pollard's rho finds a factor of a 63-bit number in milliseconds, and no
    such number has more than 103,680 divisors.
    """
    found = [1]
    for prime, power in sorted(_prime_factors(n).items()):
        found = [d * prime**k for d in found for k in range(power + 1)]
    return sorted(found)


def largest_divisor_at_most(n: int, limit: int) -> int | None:
    """The largest divisor of ``n`` that is at most ``limit`` (None if ``limit < 1``)."""
    if limit >= n:
        return n
    return max((d for d in divisors(n) if d <= limit), default=None)


# Miller-Rabin with these bases is exact below 3.3 * 10**24 (Sorenson and Webster, 2015).
_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def _prime_factors(n: int) -> dict[int, int]:
    """``{prime: power}`` of ``n >= 1``."""
    factors: dict[int, int] = {}
    for p in _BASES:
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
    pending = [n] if n > 1 else []
    while pending:
        m = pending.pop()
        if _is_prime(m):
            factors[m] = factors.get(m, 0) + 1
        else:
            d = _pollard_brent(m)
            pending += [d, m // d]
    return factors


def _is_prime(n: int) -> bool:
    """Miller-Rabin for an ``n`` with no factor in ``_BASES``, exact below 3.3 * 10**24."""
    if n < 2:
        return False
    if n in _BASES:
        return True
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _pollard_brent(n: int) -> int:
    """A non-trivial factor of the odd composite ``n`` (Brent's variant of Pollard's rho,
    the gcd taken once per 128 steps)."""
    for c in itertools.count(1):
        y, r, q, g = 2, 1, 1, 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(128, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += 128
            r *= 2
        if g == n:  # the batch overshot: step again one at a time
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if g != n:
            return g
    raise AssertionError("unreachable")

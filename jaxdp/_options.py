"""A train step's options, checked once, and what follows from them: the accumulator
dtype, the optimizer as applied, the shard plan and the backend's spelling.

:func:`jaxdp.make_train_step` takes the common options one by one and two groups:
:class:`Parallel` (how the step spreads over the mesh and what travels) and
:class:`Skips` (which updates it leaves out).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from ._checks import is_integer
from ._forward import LossReduction
from ._frozen import Trainable, skip_unused
from ._model_state import BatchStats
from ._shards import ShardPlan
from ._stages import StageLayout, stage_layout

AccumulationPath = Literal["fused", "multisteps"]
"""``"fused"``: one call per optimizer step; ``"multisteps"``: one call per micro-batch."""

Strategy = Literal["shard_map", "pmap"]
"""How the per-device step is mapped over the mesh: ``jax.shard_map`` or the legacy ``jax.pmap``."""

Remat = Literal["dots", "full"] | Callable[..., bool]
"""What stage 3's layer loop keeps for the backward (``Parallel.remat``): ``"dots"`` the
matrix products' outputs, ``"full"`` nothing, or a ``jax.checkpoint_policies`` policy."""

Regather = Literal["micro_batch", "window"]
"""When stage 3 gathers the split parameters: ``"micro_batch"`` for each micro-batch's
forward (least memory), ``"window"`` once per optimizer step, kept through its
micro-batches (stage 2's peak, 1/K of the gathers)."""

ReplicaAllReduce = Literal["per_layer", "after_backward"]
"""When HSDP all-reduces a declared stack's blocks across the replica groups
(``Parallel.replica_all_reduce``): per layer in the backward, or once after it."""

REPLICA_AXIS = "replica"
"""The name of the replica axis of the two-axis (replicas x shards) mesh that
``Parallel(zero_stage=3, shards=S)`` makes from the data mesh's devices (HSDP)."""

ZeroStage = Literal[0, 1, 2, 3]
"""0: replicated optimizer state; 1: optimizer state split over the data axis; 2: the
gradient accumulator too; 3: the parameters too, gathered for the forward
(docs/semantics.md, "ZeRO")."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallel:
    """How a step spreads over the mesh and what travels between devices
    (``make_train_step(parallel=jaxdp.Parallel(...))``; docs/semantics.md).

    ``zero_stage``: 0 keeps the optimizer state on every device; 1 (ZeRO-1,
    torch's ``ZeroRedundancyOptimizer``) splits it over the mesh: ONE
    reduce-scatter after the last micro-batch, each device updates its block of
    every parameter with its block of the state, ONE all-gather per parameter
    dtype; 2 (ZeRO-2) also splits the gradient accumulator (a reduce-scatter per
    micro-batch); 3 (ZeRO-3, FSDP: torch's ``fully_shard``) also splits the
    parameters at rest: ``state.params``' trainable leaves are global arrays split
    over the mesh (a leaf no dimension of which divides kept whole), gathered for each
    micro-batch's forward (the layers passed to :func:`jaxdp.scan_layers` one at a
    time inside its loop, the others in one all-gather per dtype up front), their
    gradients reduce-scattered in the backward, and nothing gathered after the update.
    Any optax optimizer computes what it computes at stage 0.
    ``comm_dtype``: ``"bfloat16"`` sends the gradient sums in bfloat16 (torch's
    ``bf16_compress_hook``). ``strategy``: ``"shard_map"`` or the legacy
    ``"pmap"`` (stage 0 only). ``comm_dtype`` applies to every reduce-scatter and to
    HSDP's all-reduce across replicas.

    ``bucket_cap_mb``: the most gradient bytes one collective carries, in MiB (DDP's
    ``bucket_cap_mb``, default 25; above 0 and below 2**43, XLA's int64 of bytes),
    where collectives run asynchronously (GPUs): the window's gradient all-reduce
    (stage 0) or reduce-scatter (stages 1 and 2) goes out in buckets of at most this
    size as the last micro-batch's backward computes them, each scheduled under the
    rest of that backward (DDP's overlap); nothing travels on the window's other
    micro-batches (stage 2 reduce-scatters each micro-batch's
    gradients the same way under its own backward). It is XLA's combine threshold for
    the step's own program (``TrainStep`` compiles with it; the process's ``XLA_FLAGS``
    are left alone). XLA:CPU runs collectives synchronously: there the reduction is
    one collective after the backward (one per dtype at stages 1 and 2), as nothing
    could run under it. The legacy ``pmap`` strategy sends the same buckets.

    Stage 3 only (refused at stages 0 to 2, which split nothing at rest):

    ``shards``: HSDP (torch's ``fully_shard`` on a 2-D ``(replicate, shard)`` device
    mesh, MaxText's ``data`` x ``fsdp`` axes). None (default): every device of the
    mesh is one shard group (FSDP). ``S`` (at least 2, dividing ``num_devices``): the
    step runs on the ``(num_devices // S, S)`` mesh of the same devices, in the same
    order (axes ``"replica"`` and the data mesh's axis). The batch is split over
    every device as on the one-axis mesh; parameters, the gradient accumulator and
    the optimizer state are split over the S devices of a shard group, and every
    replica group holds the same copy. Gradients are reduce-scattered within the
    shard group per micro-batch and all-reduced across the replica groups ONCE per
    optimizer step, after the last micro-batch (DDP's ``no_sync`` on the others).
    ``shards=num_devices`` is plain stage 3. In a multi-process run each shard group's
    devices must belong to one process.

    ``regather``: ``"micro_batch"`` (default) gathers the parameters for every
    micro-batch's forward (and again in its backward, inside
    :func:`jaxdp.scan_layers`): the least memory, K times the gathers.
    ``"window"`` gathers every split parameter ONCE per optimizer step, before the
    micro-batch loop, and keeps it whole through the window (stage 2's peak, 1/K of
    the gathers; the gradients reduce-scattered per micro-batch as at stage 2).
    Fused path only: on ``"multisteps"`` a window spans calls, and keeping the
    gathered parameters between calls would hold them whole in the state.

    ``replica_all_reduce`` (HSDP): when a declared stack's blocks are all-reduced
    across the replica groups on the window's last micro-batch. ``"per_layer"``
    (default; torch FSDP2's HSDP) inside :func:`jaxdp.scan_layers`' backward, each
    layer's after its reduce-scatter, under the next layer's backward, so the cross-host
    bytes travel under the backward (on GPUs' spelling); ``"after_backward"`` ONCE after
    it, which leaves the reduce-scatters within the shard group more room. A trade
    XLA:GPU's schedule makes (BENCHMARKS.md, section 9: GPT-2 small on 2 x 8 H100s,
    K = 4, the cross-host all-reduce 91% against 16% hidden but the embedding-sized
    blocks', the reduce-scatters 84% against 89% but each micro-batch's first and
    last). The sums, and so the update, are the same.

    ``remat``: what :func:`jaxdp.scan_layers`' loop keeps of each layer for the
    backward, which gathers the layer's weights again either way (no gathered weight is
    kept: the peak holds one layer's weights). ``"dots"`` (default, FSDP2's: activations
    kept, the weights gathered again): the matrix products' outputs
    (``jax.checkpoint_policies.dots_saveable``); the backward recomputes the layer's
    elementwise work, never a matrix product. ``"full"``: nothing but the layer's input
    (``nothing_saveable``: full activation checkpointing, the least memory; the backward
    runs each layer's forward again). Or any ``jax.checkpoint_policies`` policy.

    ``layers``: which parameter leaves are stacks of layers, their first dimension the
    layer axis, that ``loss_fn`` hands to :func:`jaxdp.scan_layers` (and to nothing
    else). None (default): the model says, by its sharding metadata, a leaf whose first
    name is ``"layers"`` (``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME:
    "layers"})`` over Variables with ``out_sharding``, MaxText's name); a sequence of
    names: the leaves under a key of one of those names (``("blocks",)``); or a callable
    ``(path, leaf) -> bool``. At stages 0 to 2 on GPUs each layer's gradient then leaves
    the loop's backward as that layer's backward ends (all-reduced at stage 0,
    reduce-scattered at stages 1 and 2, on the micro-batches that communicate), under
    the backward of the layers before it, as an unrolled model's do; the step hands
    ``loss_fn`` those leaves as ``jaxdp.scan_layers``' own (a use other than the loop or
    ``astype`` is refused, naming the leaf). XLA:CPU keeps its program (nothing
    overlaps there). At stage 3 (on every backend) :func:`jaxdp.scan_layers` gathers a
    declared stack a layer at a time; with no stack declared every split leaf is
    gathered whole per micro-batch (said in one warning). The step never guesses a
    stack from ``loss_fn``.

    ``model_axes``: the mesh's axes the model's own shardings use (tensor parallelism:
    a kernel annotated ``(None, "model")`` by ``nnx.with_partitioning``, column-split over
    ``"model"``), left to XLA's partitioner; the mesh's one other axis is the data axis,
    over which the step splits the batch and reduces the gradients, manually, once per
    optimizer step. ``()`` (default): a one-axis data mesh. Every leaf rests split over
    the model axes as its metadata says (the parameters, their gradients, the window's
    sums and the optimizer state's leaves of the parameter's tree), and at ZeRO stages 1
    to 3 over the data axis along a dimension its model split leaves free; jaxdp's own
    collectives run on each device's model shards, over the data axis only. Under HSDP
    (``shards``) the step's mesh is ``(replica, data, *model_axes)``. The legacy pmap
    strategy takes no model axis.

    ``gather_dtype``: the dtype the parameters travel and compute in (torch FSDP2's
    ``MixedPrecisionPolicy(param_dtype=...)``): ``"bfloat16"`` gathers float32 master
    weights in bfloat16, and the forward and backward compute on those rounded
    weights; the optimizer updates the master weights, and the gradients are
    reduce-scattered in the parameters' dtype (or ``comm_dtype``). None: their own;
    else bfloat16, float16, float32 or float64.
    """

    zero_stage: ZeroStage = 0
    bucket_cap_mb: float = 25
    comm_dtype: Any = None
    strategy: Strategy = "shard_map"
    shards: int | None = None
    regather: Regather = "micro_batch"
    remat: Remat = "dots"
    gather_dtype: Any = None
    layers: Any = None
    replica_all_reduce: ReplicaAllReduce = "per_layer"
    model_axes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        axes = (self.model_axes,) if isinstance(self.model_axes, str) else self.model_axes
        try:
            axes = tuple(axes)
        except TypeError:
            axes = None
        if axes is None or not all(isinstance(a, str) for a in axes) or len(set(axes)) < len(axes):
            raise ValueError(
                f"model_axes={self.model_axes!r} must be a sequence of distinct mesh axis "
                "names (the model's own, tensor-parallel axes), or () for none"
            )
        object.__setattr__(self, "model_axes", axes)
        if axes and self.strategy == "pmap":
            raise ValueError(
                f"model_axes={axes} needs strategy='shard_map': pmap maps every axis, and "
                "a model axis is left to XLA's partitioner"
            )
        layers = self.layers
        if isinstance(layers, str):
            object.__setattr__(self, "layers", (layers,))
        elif layers is not None and not callable(layers):
            try:
                names = tuple(layers)
            except TypeError:
                names = None
            if names is None or not all(isinstance(n, str | int) for n in names):
                raise ValueError(
                    f"layers={layers!r} must be None (the model's metadata says), a sequence "
                    "of key names (the leaves under them are stacks of layers) or a callable "
                    "(path, leaf) -> bool"
                )
            object.__setattr__(self, "layers", names)
        if not is_integer(self.zero_stage) or self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3")
        object.__setattr__(self, "zero_stage", int(self.zero_stage))
        if self.strategy not in ("shard_map", "pmap"):
            raise ValueError(f"strategy={self.strategy!r} must be one of ('shard_map', 'pmap')")
        if self.comm_dtype is not None and _dtype_or_none(self.comm_dtype) != jnp.bfloat16:
            raise ValueError(
                f"comm_dtype={self.comm_dtype!r} must be None (gradients travel in the "
                "accumulator dtype) or 'bfloat16'"
            )
        cap = self.bucket_cap_mb
        # XLA takes the cap as an int64 count of bytes: below 2**63 bytes, 2**43 MiB.
        if not isinstance(cap, numbers.Real) or isinstance(cap, bool) or not 0 < cap < 2**43:
            raise ValueError(
                f"bucket_cap_mb={cap!r} must be a positive number of MiB below 2**43 "
                "(XLA's combine threshold is an int64 count of bytes; DDP's default: 25)"
            )
        object.__setattr__(self, "bucket_cap_mb", float(cap))
        self._check_stage_3_fields()
        if self.zero_stage and self.strategy == "pmap":
            raise ValueError(
                f"zero_stage={self.zero_stage} needs strategy='shard_map' (the legacy pmap "
                "strategy keeps every leaf replicated); use strategy='shard_map' or "
                "zero_stage=0"
            )

    def _check_stage_3_fields(self) -> None:
        shards = self.shards
        if shards is not None and (not is_integer(shards) or shards < 2):
            raise ValueError(
                f"shards={shards!r} must be None (one shard group of every device) or an "
                "integer of at least 2 (devices per shard group); shards=1 would keep a "
                "whole copy on every device: that is zero_stage=0 (DDP)"
            )
        if shards is not None:
            object.__setattr__(self, "shards", int(shards))
        if self.regather not in ("micro_batch", "window"):
            raise ValueError(f"regather={self.regather!r} must be 'micro_batch' or 'window'")
        if self.replica_all_reduce not in ("per_layer", "after_backward"):
            raise ValueError(
                f"replica_all_reduce={self.replica_all_reduce!r} must be 'per_layer' or "
                "'after_backward'"
            )
        if self.replica_all_reduce != "per_layer" and shards is None:
            raise ValueError(
                f"replica_all_reduce={self.replica_all_reduce!r} needs HSDP (zero_stage=3 "
                "with shards=S): without shards there is one shard group and no all-reduce "
                "across replica groups"
            )
        if not callable(self.remat) and self.remat not in ("dots", "full"):
            raise ValueError(
                f"remat={self.remat!r} must be 'dots' (the matrix products' outputs kept), "
                "'full' (nothing kept) or a jax.checkpoint_policies policy"
            )
        dtype = None if self.gather_dtype is None else _dtype_or_none(self.gather_dtype)
        # The forward computes on the gathered weights with the batch: JAX promotes no 8-bit
        # or smaller float with another implicitly (a TypePromotionError at the first step).
        gather_dtypes = ("bfloat16", "float16", "float32", "float64")
        if self.gather_dtype is not None and (dtype is None or dtype.name not in gather_dtypes):
            raise ValueError(
                f"gather_dtype={self.gather_dtype!r} must be None (the parameters' own "
                f"dtype) or one of {gather_dtypes}: the forward computes on the gathered "
                "weights, and JAX promotes no float8 (or smaller) dtype with others"
            )
        defaults = {
            "shards": None,
            "regather": "micro_batch",
            "remat": "dots",
            "gather_dtype": None,
        }
        given = [f"{k}={getattr(self, k)!r}" for k, v in defaults.items() if getattr(self, k) != v]
        if given and self.zero_stage != 3:
            raise ValueError(
                f"{', '.join(given)} needs zero_stage=3 (the parameters split at rest), got "
                f"zero_stage={self.zero_stage}: stages 0 to 2 keep every parameter whole "
                "on every device and gather nothing"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Skips:
    """Which updates a step leaves out (``make_train_step(skips=jaxdp.Skips(...))``).

    ``nonfinite``: if the all-reduced gradients, loss or batch statistics hold a
    NaN or Inf (from any device), skip the update on every device: parameters,
    optimizer state and batch statistics stay, the step count does not advance,
    the window restarts (``metrics["skipped"]``, ``"skipped_steps"``,
    ``"consecutive_skips"``; ``metrics["finite"]`` either way).
    ``max_consecutive``: raise :class:`jaxdp.NonFiniteError`, before a call uses its
    batch, once this many updates in a row were skipped (None: never).
    ``unused``: a parameter whose all-reduced gradient is exactly zero takes no
    optimizer step, like torch skips parameters whose ``.grad`` is None.
    """

    nonfinite: bool = True
    max_consecutive: int | None = 10
    unused: bool = False

    def __post_init__(self) -> None:
        limit = self.max_consecutive
        if limit is not None and (not is_integer(limit) or limit < 1):
            raise ValueError(f"max_consecutive_skips={limit!r} must be a positive integer or None")
        if limit is not None:
            object.__setattr__(self, "max_consecutive", int(limit))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOptions:
    """The arguments of :func:`jaxdp.make_train_step` (see there), after checking."""

    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    mesh: Mesh
    accum_steps: int = 1
    path: AccumulationPath = "fused"
    loss_reduction: LossReduction = "mean"
    has_aux: bool = False
    accum_dtype: Any = None
    donate: bool = True
    batch_stats: BatchStats | None = None
    rng_seed: int | None = None
    trainable: Trainable = None
    parallel: Parallel = Parallel()
    skips: Skips = Skips()
    # The XLA:CPU spellings of the step (jaxdp/_pipeline.py, "XLA:CPU spelling"): chosen
    # when the step is made, on a CPU mesh unless jaxdp.testing.plain_spelling() is on.
    cpu_spelling: bool | None = None
    # The warnings given so far (their texts): once per step, however often it traces.
    warned: set[str] = dataclasses.field(default_factory=set, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_objects(self.loss_fn, self.optimizer, self.mesh)
        if self.cpu_spelling is None:
            cpu = self.mesh.devices.flat[0].platform == "cpu" and not _PLAIN_SPELLING.get()
            object.__setattr__(self, "cpu_spelling", cpu)
        if not is_integer(self.accum_steps) or self.accum_steps < 1:
            raise ValueError(f"accum_steps={self.accum_steps!r} must be a positive integer")
        object.__setattr__(self, "accum_steps", int(self.accum_steps))
        if self.rng_seed is not None and not is_integer(self.rng_seed):
            raise ValueError(f"rng_seed={self.rng_seed!r} must be an integer or None")
        if self.rng_seed is not None:
            object.__setattr__(self, "rng_seed", int(self.rng_seed))
        for name, allowed in (
            ("path", ("fused", "multisteps")),
            ("loss_reduction", ("mean", "weighted")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        if not isinstance(self.has_aux, bool):
            raise TypeError(f"has_aux={self.has_aux!r} must be True or False")
        if self.batch_stats not in (None, "local", "sync"):
            raise ValueError(f"batch_stats={self.batch_stats!r} must be None, 'local' or 'sync'")
        for name, kind in (("parallel", Parallel), ("skips", Skips)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(
                    f"{name}={getattr(self, name)!r} must be a jaxdp.{kind.__name__}(...)"
                )
        self._check_axes()
        self._check_hsdp()

    def _check_axes(self) -> None:
        """The mesh has the model axes named and one data axis besides them."""
        names, model = tuple(self.mesh.axis_names), self.parallel.model_axes
        lacking = [a for a in model if a not in names]
        if lacking:
            raise ValueError(
                f"parallel.model_axes={model} names axes the mesh lacks: {lacking} (the "
                f"mesh's axes: {names})"
            )
        types = dict(zip(names, getattr(self.mesh, "axis_types", ()) or (), strict=False))
        explicit = [a for a in model if types.get(a) == jax.sharding.AxisType.Explicit]
        if explicit:
            raise ValueError(
                f"parallel.model_axes={model}: the mesh's axes {explicit} are "
                "AxisType.Explicit, and jaxdp leaves its model axes to XLA's partitioner, "
                "which takes Auto axes (jax.make_mesh makes Explicit ones by default): make "
                "the mesh with axis_types=(jax.sharding.AxisType.Auto,) * len(axes)"
            )
        data = [a for a in names if a not in model]
        if len(data) != 1:
            raise ValueError(
                f"mesh has axes {names}, and jaxdp's step takes one data axis besides the "
                f"model's own axes (Parallel(model_axes=...), now {model}): "
                + (
                    "every axis is a model axis"
                    if not data
                    else f"name the model's axes among {tuple(data)} in "
                    "Parallel(model_axes=...), keeping one data axis"
                )
            )

    def _check_hsdp(self) -> None:
        n, shards, axis = self.num_devices, self.parallel.shards, self.axis_name
        if self.parallel.regather == "window" and self.path == "multisteps":
            raise ValueError(
                "regather='window' needs path='fused': on 'multisteps' each call is one "
                "micro-batch, and keeping the gathered parameters through a window of calls "
                "would hold them whole in the state; use path='fused' or "
                "regather='micro_batch'"
            )
        if shards is None:
            return
        if n % shards:
            raise ValueError(
                f"shards={shards} must divide num_devices={n} (the mesh's devices form "
                f"num_devices // shards replica groups of shards devices each)"
            )
        if axis == REPLICA_AXIS:
            raise ValueError(
                f"shards={shards} names the new replica axis {REPLICA_AXIS!r}: give the "
                f"data mesh another axis name than {axis!r}"
            )
        if shards == n:  # one group of every device: plain stage 3, on the one-axis mesh
            return
        for group in self.device_mesh.devices.reshape(
            -1, shards * math.prod(self.mesh.shape[a] for a in self.model_axes)
        ):  # device r * shards + s, and its model devices
            processes = sorted({d.process_index for d in group})
            if len(processes) > 1:
                raise ValueError(
                    f"shards={shards}: every shard group's devices must belong to one "
                    f"process (its gathers and reduce-scatters stay on one host), but mesh "
                    f"devices {[d.id for d in group]} belong to processes {processes}; use "
                    f"shards dividing the devices per process"
                )

    @property
    def zero_stage(self) -> int:
        """The user's ``Parallel.zero_stage``, for messages: behaviour reads :attr:`layout`."""
        return self.parallel.zero_stage

    @functools.cached_property
    def layout(self) -> StageLayout:
        """What the stage splits (:class:`jaxdp._stages.StageLayout`): the one place the
        step reads its ZeRO stage from."""
        return stage_layout(self.parallel.zero_stage)

    @property
    def comm(self) -> Any:
        """The gradients' dtype on the wire: None (their own) or ``jnp.bfloat16``."""
        return None if self.parallel.comm_dtype is None else jnp.dtype(jnp.bfloat16)

    @property
    def num_devices(self) -> int:
        """The devices the batch is split over: the data axis's size (every device of
        a one-axis mesh)."""
        return self.mesh.shape[self.axis_name]

    @property
    def axis_name(self) -> str:
        """The data mesh's axis (the mesh's one axis not in ``Parallel.model_axes``); the
        shard axis of the device mesh."""
        model = self.parallel.model_axes
        return next(a for a in self.mesh.axis_names if a not in model)

    @property
    def model_axes(self) -> tuple[str, ...]:
        """The mesh's axes left to XLA (``Parallel.model_axes``): the model's own."""
        return self.parallel.model_axes

    @property
    def shards(self) -> int:
        """Devices per shard group: ``Parallel.shards``, else all of them."""
        return self.parallel.shards or self.num_devices

    @property
    def regathers_per_window(self) -> bool:
        """Stage 3 gathers the parameters once per window (``regather="window"``)."""
        return self.layout.params_split and self.parallel.regather == "window"

    @property
    def gathers_per_micro_batch(self) -> bool:
        """Stage 3 gathers the parameters for each micro-batch's forward (the default
        ``regather="micro_batch"``), whose backward reduce-scatters their gradients."""
        return self.layout.params_split and not self.regathers_per_window

    @property
    def scatters_per_micro_batch(self) -> bool:
        """The step reduce-scatters each micro-batch's gradients into the window's blocks
        itself: stage 2, and stage 3 gathered per window (gathered per micro-batch, the
        gather's backward does)."""
        return self.layout.window_split and not self.gathers_per_micro_batch

    @functools.cached_property
    def device_mesh(self) -> Mesh:
        """The mesh the step runs on: the data mesh, or under HSDP the ``(replicas,
        shards)`` mesh of its devices in the same order (device ``r * shards + s``), the
        model axes after them (``(replicas, shards, model)``, each data rank's model
        devices as the mesh has them)."""
        if self.shards == self.num_devices:
            return self.mesh
        names = tuple(self.mesh.axis_names)
        devices = np.moveaxis(self.mesh.devices, names.index(self.axis_name), 0)
        grid = devices.reshape(self.num_devices // self.shards, self.shards, *devices.shape[1:])
        model = tuple(a for a in names if a != self.axis_name)
        types = dict(zip(names, getattr(self.mesh, "axis_types", ()) or (), strict=False))
        if not model:
            return Mesh(grid, (REPLICA_AXIS, self.axis_name))
        auto = jax.sharding.AxisType.Auto
        axes = (REPLICA_AXIS, self.axis_name, *model)
        return Mesh(grid, axes, axis_types=tuple(types.get(a, auto) for a in axes))

    @property
    def batch_axes(self) -> str | tuple[str, ...]:
        """The device mesh's axes the batch is split over (all but the model axes), for specs and
        for the collectives over every device."""
        names = [a for a in self.device_mesh.axis_names if a not in self.model_axes]
        return names[0] if len(names) == 1 else tuple(names)

    @functools.cached_property
    def process_count(self) -> int:
        """Processes whose devices make up the mesh (1 unless multi-process); read
        on every call of the step, so counted once."""
        return len({d.process_index for d in self.mesh.devices.flat})

    @property
    def applied_optimizer(self) -> optax.GradientTransformation:
        """The user's optimizer as the step applies it (wrapped by ``Skips(unused=True)``)."""
        return skip_unused(self.optimizer) if self.skips.unused else self.optimizer

    def accumulator_dtype(self, params: Any) -> Any:
        """``accum_dtype``, else float64 if any parameter is float64, else float32."""
        if self.accum_dtype is not None:
            return jnp.dtype(self.accum_dtype)
        wide = any(jnp.dtype(x.dtype) == jnp.float64 for x in jax.tree.leaves(params))
        return jnp.dtype(jnp.float64 if wide else jnp.float32)

    def warn_once(self, message: str) -> None:
        """A ``UserWarning`` the first time this step gives ``message``."""
        if message not in self.warned:
            self.warned.add(message)
            warnings.warn(message, UserWarning, stacklevel=2)

    def plan(self, trainable: Any) -> ShardPlan:
        """Where the trainable leaves lie: split at ZeRO stages, whole at stage 0."""
        return ShardPlan(
            trainable,
            self.device_mesh,
            self.layout,
            packed=self.cpu_spelling,
            layers=self.parallel.layers,
            model_axes=self.model_axes,
            optimizer=self.applied_optimizer,
        )

    def compiler_options(self, routed: bool = False) -> dict[str, int]:
        """The XLA options the step's own program is compiled with (never the process's
        ``XLA_FLAGS``): on GPUs, XLA combines the gradient collectives into buckets of
        at most ``Parallel.bucket_cap_mb`` of gradient sums (its default threshold is
        30 MiB). XLA measures a reduce-scatter by its result, each device's block: a
        shard group's share of the bucket. ``routed``: the program sends a declared
        stack's gradients layer by layer at stages 0 to 2 (``jaxdp._pipeline``'s
        routing, which the step reads from the state it is called with)."""
        if self.mesh.devices.flat[0].platform != "gpu":
            return {}
        cap = int(self.parallel.bucket_cap_mb * 2**20)
        # How many buckets XLA's scheduler keeps in flight at once, at stages 0 to 3: the
        # one that left the fewest after the last matrix product of GPT-2 small's steps
        # compiled for 8 H100s (the share of the bytes but the tied embedding's hidden, one
        # bucket in flight against two: stage 0 94% against 69%, stage 1 80% against 94%,
        # stage 2 94% against 80%; tests/gpu holds each). The peak did not change. A
        # tuning measured per stage, so keyed by its number, not by what it splits.
        in_flight = (1, 2, 1, 2)[self.layout.zero_stage]
        if routed and not self.layout.params_split:
            # A scanned stack's layers, one collective each (jaxdp._layers.Route), hid
            # more with one in flight at stage 1 too: the scanned GPT-2 small on 8 H100s
            # 91.7% against 83.5% of the bytes but the embeddings' (BENCHMARKS.md section
            # 9, "The scanned model"); two in flight paired the last layers' under
            # each other, after the products.
            in_flight = 1
        # At stage 3 an all-reduce carries blocks too (HSDP's across the replica groups):
        # a shard group's share of the bucket, as the reduce-scatter's. At the whole cap
        # XLA combined the untied head's block, done first, with the backward's last layer.
        options = {
            "xla_gpu_all_reduce_combine_threshold_bytes": (
                max(1, cap // self.shards) if self.layout.params_split else cap
            ),
            "xla_gpu_reduce_scatter_combine_threshold_bytes": max(1, cap // self.shards),
            "xla_gpu_experimental_parallel_collective_overlap_limit": in_flight,
        }
        if self.layout.params_split:
            # The layer loops' gathers one layer ahead (XLA's collective pipeliner: in
            # flight while the layer before computes, in the forward and the backward),
            # each started as soon as its shard is there. Without them no gather of a
            # scanned GPT-2 small hid under a matrix product on 8 H100s.
            # Not HSDP's all-reduces across the replica groups: jaxdp._layers sends each
            # layer's one layer later itself, and the pipeliner peels another layer out of
            # the backward's loop for each kind it moves.
            options |= _collective_pipelining(("all_gather", "reduce_scatter"))
            options["xla_gpu_experimental_collective_start_as_early_as_possible"] = True
        return options


def _collective_pipelining(
    kinds: tuple[str, ...] = ("all_gather", "reduce_scatter"),
) -> dict[str, Any]:
    """XLA:GPU's options that pipeline ``kinds`` of collectives (all-gathers and
    reduce-scatters) across a loop's iterations, in the spelling this jaxlib takes: an
    enum from jaxlib 0.11 or so (``xla_gpu_pipeline_all_gather``), booleans before
    (``xla_gpu_enable_pipelined_*``, which the later ones refuse); none if it takes
    neither."""
    spellings = (
        ("xla_gpu_pipeline_{}", "COLLECTIVE_PIPELINING_MODE_ON"),
        ("xla_gpu_enable_pipelined_{}", True),
    )
    for name, on in spellings:
        options = {name.format(kind): on for kind in kinds}
        if _takes(tuple(options.items())):
            return options
    return {}


@functools.cache
def _takes(options: tuple[tuple[str, Any], ...]) -> bool:
    """Whether this jaxlib's XLA takes these compile options (their names and values
    change between releases): a trivial program compiled with them, once per process."""
    try:
        jax.jit(lambda x: x, compiler_options=dict(options)).lower(jnp.zeros(())).compile()
    except Exception:  # XLA's "No such compile option" / "not a valid enum value"
        return False
    return True


_PLAIN_SPELLING = contextvars.ContextVar("jaxdp_plain_spelling", default=False)


@contextlib.contextmanager
def plain_spelling():
    """Steps made inside run every backend's plain spelling, also on a CPU mesh: the
    divide, the select and the plain reset that GPUs and TPUs take where a CPU mesh
    takes its XLA:CPU spellings (jaxdp/_pipeline.py). For tests: jaxdp.testing."""
    token = _PLAIN_SPELLING.set(True)
    try:
        yield
    finally:
        _PLAIN_SPELLING.reset(token)


# make_train_step's spellings before the groups (jaxdp 0.2), accepted with a warning.
OLD_SPELLINGS = {
    "strategy": ("parallel", "strategy"),
    "zero_stage": ("parallel", "zero_stage"),
    "comm_dtype": ("parallel", "comm_dtype"),
    "skip_nonfinite": ("skips", "nonfinite"),
    "max_consecutive_skips": ("skips", "max_consecutive"),
    "skip_unused": ("skips", "unused"),
}


def fold(
    options: dict[str, Any],
    *,
    parallel: dict[str, Any] | None = None,
    skips: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """:func:`jaxdp.make_train_step`'s keywords from ``options`` in either spelling: the
    spellings of jaxdp 0.2 (with a ``DeprecationWarning``) folded into the groups
    ``parallel`` and ``skips``, over the group fields given here as defaults. A group
    given whole in ``options`` is taken as it is; with an old spelling of its fields
    too, a ``TypeError``."""
    out = {k: v for k, v in options.items() if k not in OLD_SPELLINGS}
    fields = {"parallel": dict(parallel or {}), "skips": dict(skips or {})}
    moved: dict[str, list[str]] = {"parallel": [], "skips": []}
    for name, value in options.items():
        if name not in OLD_SPELLINGS:
            continue
        group, field = OLD_SPELLINGS[name]
        if out.get(group) is not None:
            raise TypeError(
                f"make_train_step() got {name}= and {group}=; {name} is {group}.{field} "
                f"since jaxdp 0.3: give it inside {group}= only"
            )
        fields[group][field] = value
        moved[group].append(name)
    for group, names in moved.items():
        if names:
            new = ", ".join(f"{OLD_SPELLINGS[n][1]}=..." for n in names)
            warnings.warn(
                f"make_train_step({', '.join(f'{n}=' for n in names)}) is deprecated since "
                f"jaxdp 0.3 and goes in 0.4: write {group}=jaxdp.{group.capitalize()}({new})",
                DeprecationWarning,
                stacklevel=3,
            )
    for group, kind in (("parallel", Parallel), ("skips", Skips)):
        if out.get(group) is None and (fields[group] or group in out):
            out[group] = kind(**fields[group])
    return out


def _dtype_or_none(value: Any) -> Any:
    try:
        return jnp.dtype(value)
    except TypeError:
        return None


def _check_objects(loss_fn: Any, optimizer: Any, mesh: Any) -> None:
    """The three things a step is built from are what they must be (not a factory, a list)."""
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn={loss_fn!r} must be callable: loss_fn(params, micro_batch) -> loss"
        )
    if not all(callable(getattr(optimizer, name, None)) for name in ("init", "update")):
        if callable(optimizer):
            what = "a function, not an optax.GradientTransformation; call it (optax.sgd(0.1))"
        else:
            what = f"a {type(optimizer).__name__}, not an optax.GradientTransformation"
        raise TypeError(f"optimizer={optimizer!r} is {what}")
    if not isinstance(mesh, Mesh):
        got, fix = f"a {type(mesh).__name__}", "jaxdp.data_mesh(num_devices)"
        if isinstance(mesh, (list, tuple)) and all(isinstance(d, jax.Device) for d in mesh):
            got, fix = f"{got} of {len(mesh)} devices", "jaxdp.data_mesh(devices=those_devices)"
        raise TypeError(
            f"mesh= must be a jax.sharding.Mesh with one axis, got {got}; build it with {fix}"
        )

"""The planner's view of a model jaxdp can build: its sizes, and XLA's memory analysis.

``compiled_memory`` reads XLA's buffer assignment of a compiled step (per
device: the step is one SPMD program). Where the estimate of
:mod:`jaxdp.plan` and XLA are compared, the parts line up as

- arguments: weights + optimizer state + the per-device batch (+ the step counters);
- temporaries: micro-batch gradients + the float32 accumulator + activations
  (+ XLA's fusion scratch, which the estimate does not model);
- outputs not aliased to arguments: the metrics (the state is donated).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._forward import loss_parts, split_model
from .._model_state import split_state
from .._options import Parallel
from .._shards import resting_size
from .._stages import stage_layout
from .._step import make_train_step
from .._train_state import TrainState
from ..models import MODELS, TENSOR_PARALLEL
from ._memory import divisors, largest_divisor_at_most

_MAX_COMPILES = 8  # per choice; each is fast (abstract batches) but not free
_RESIDUAL_ROWS = (8, 16)  # two micro-batch sizes whose difference gives bytes per sample


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's memory analysis of one compiled program, bytes per device.

    Attributes:
      arguments: the program's inputs (the state, the batch, the micro-batch weights).
      outputs: its outputs.
      aliased: output bytes written into (donated) argument buffers.
      temporaries: the buffers it allocates while it runs (its temporary allocation).
      peak: XLA's own peak of the program's buffers over its schedule (arguments and
        temporaries live at once at the worst point), where the backend reports one (XLA:GPU,
        compile-only GPUs included); None where it does not. XLA:CPU's
        ``peak_memory_in_bytes`` is no such peak: it is the arguments plus the outputs (and 4
        bytes), without the temporaries (jax 0.10.2: a gradient with 3 MiB of temporaries,
        1.5 MiB of arguments and 1 MiB of outputs reports 2.5 MiB), so on CPU ``peak`` is
        None and :attr:`total` is the bound to read.
    """

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    peak: int | None = None

    @property
    def total(self) -> int:
        """Peak bytes the program needs: arguments, temporaries, unaliased outputs."""
        return self.arguments + self.temporaries + self.outputs - self.aliased


def compiled_memory(compiled: Any) -> CompiledMemory:
    """XLA's figures for ``compiled`` (e.g. ``step.compile(state, batch)``, also for the
    compile-only GPUs of :func:`jaxdp.testing.gpu_mesh`: per device)."""
    stats = compiled.memory_analysis()
    peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    if _platform(compiled) == "cpu":
        peak = 0  # XLA:CPU's figure leaves the temporaries out: no peak (see CompiledMemory)
    return CompiledMemory(
        arguments=int(stats.argument_size_in_bytes),
        outputs=int(stats.output_size_in_bytes),
        aliased=int(stats.alias_size_in_bytes),
        temporaries=int(stats.temp_size_in_bytes),
        peak=peak or None,
    )


def _platform(compiled: Any) -> str | None:
    """The platform ``compiled`` runs on, from its shardings (None if it has none)."""
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    devices = [d for s in shardings for d in s.device_set]
    return devices[0].platform if devices else None


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A reference model of :mod:`jaxdp.models` with its sizes and batch layout."""

    name: str
    kwargs: dict[str, Any]
    make: Callable[[], nnx.Module]
    loss: Callable[..., jax.Array]
    batch: Callable[[int], Any]  # rows -> (x, y) as ShapeDtypeStructs

    def describe(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"


def reference_model(
    name: str, *, param_dtype: Any = jnp.float32, seed: int = 0, tp: bool = False, **kwargs: Any
) -> ModelSpec:
    """The spec of reference model ``name`` with constructor arguments ``kwargs``; ``tp``:
    with its tensor-parallel plan (the models of ``jaxdp.models.TENSOR_PARALLEL``).

    Batches follow the reference data: ``linear``/``mlp`` rows of
    ``in_features`` floats, ``cnn`` 8x8 images (the digits) with
    ``in_channels``, ``transformer`` ``block_size`` tokens; labels int32.
    """
    if name not in MODELS:
        raise ValueError(f"model={name!r} must be one of {sorted(MODELS)}")
    if tp and name not in TENSOR_PARALLEL:
        raise ValueError(
            f"model={name!r} has no tensor-parallel plan; the models with one: {TENSOR_PARALLEL}"
        )
    cls, loss = MODELS[name]
    signature = inspect.signature(cls.__init__)
    defaults = {
        k: p.default
        for k, p in signature.parameters.items()
        if p.default is not inspect.Parameter.empty and k not in ("param_dtype", "tp")
    }
    unknown = sorted(set(kwargs) - set(defaults))
    if unknown:
        raise ValueError(
            f"model argument(s) {unknown} are not arguments of {name}; it takes {sorted(defaults)}"
        )
    for key, value in kwargs.items():
        _check_size(name, key, value, defaults[key])
    sizes = defaults | kwargs
    takes_rngs = "rngs" in signature.parameters

    def make() -> nnx.Module:
        extra = {"rngs": nnx.Rngs(seed)} if takes_rngs else {}
        if tp:
            extra["tp"] = True
        return cls(**kwargs, param_dtype=param_dtype, **extra)

    def batch(rows: int) -> Any:
        f32, i32 = jnp.float32, jnp.int32
        if name == "linear":  # y is unused by the seed's sum loss
            x = jax.ShapeDtypeStruct((rows, sizes["in_features"]), f32)
            return x, jax.ShapeDtypeStruct((rows, 1), f32)
        if name == "mlp":
            x = jax.ShapeDtypeStruct((rows, sizes["in_features"]), f32)
            return x, jax.ShapeDtypeStruct((rows,), i32)
        if name == "cnn":
            x = jax.ShapeDtypeStruct((rows, 8, 8, sizes["in_channels"]), f32)
            return x, jax.ShapeDtypeStruct((rows,), i32)
        tokens = jax.ShapeDtypeStruct((rows, sizes["block_size"]), i32)
        return tokens, tokens

    return ModelSpec(name, kwargs, make, loss, batch)


def _nbytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _check_size(model: str, key: str, value: Any, default: Any) -> None:
    """Every argument of a reference model is a size: a positive integer, or a tuple of
    them as long as its default (the CNN's ``channels``)."""

    def size(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    if isinstance(default, tuple):
        if isinstance(value, tuple) and len(value) == len(default) and all(map(size, value)):
            return
        rule = f"a tuple of {len(default)} positive integers"
    elif size(value):
        return
    else:
        rule = "a positive integer"
    raise ValueError(
        f"model argument {key}={value!r} of {model} must be {rule}, as its default {default!r}"
    )


def param_count(spec: ModelSpec) -> int:
    """Parameters of the model (built abstractly: no memory is allocated)."""
    _, params, _ = split_model(nnx.eval_shape(spec.make))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def padded_param_count(spec: ModelSpec, num_devices: int) -> int:
    """Parameters of the model as ZeRO stage 3 holds them split over ``num_devices`` (a
    shard group's): each leaf no dimension of which its rule gives divides padded to a
    multiple of them (:func:`jaxdp._shards.resting_size`)."""
    _, params, _ = split_model(nnx.eval_shape(spec.make))
    return resting_size([x.shape for x in jax.tree.leaves(params)], num_devices, stage_layout(3))


def input_bytes_per_sample(spec: ModelSpec) -> int:
    """Bytes of one row of the batch (inputs and labels)."""
    return _nbytes(spec.batch(1))


def activation_bytes_per_sample(spec: ModelSpec) -> float:
    """Bytes per sample of the values JAX's autodiff saves for the backward pass.

    The residuals of ``jax.vjp`` of the loss, measured abstractly at two
    micro-batch sizes; their difference per row is what one more sample
    costs. It is the program before XLA's optimizations: fusion may
    recompute cheap values instead of keeping them, and backward scratch
    comes on top.
    """
    graphdef, params, rest = split_model(nnx.eval_shape(spec.make))

    def residuals(params: Any, rest: Any, batch: Any) -> list[jax.Array]:
        parts = loss_parts(spec.loss, "mean", graphdef)

        def loss(p: Any) -> jax.Array:
            return parts(p, batch, *split_state(rest), None)[0]

        return jax.tree.leaves(jax.vjp(loss, params)[1])

    small, large = (
        _nbytes(jax.eval_shape(residuals, params, rest, spec.batch(rows)))
        for rows in _RESIDUAL_ROWS
    )
    return (large - small) / (_RESIDUAL_ROWS[1] - _RESIDUAL_ROWS[0])


def activation_bytes(
    loss_fn: Callable[..., Any],
    model: Any,
    batch: Any,
    *,
    remat: Any = None,
    layers: Any = None,
    loss_reduction: Literal["mean", "weighted"] = "mean",
    has_aux: bool = False,
) -> float:
    """What one more sample of a micro-batch keeps for the backward: the bytes of the
    residuals of ``jax.vjp`` of ``loss_fn(model, batch)`` (what JAX's autodiff saves),
    from abstract traces at ``batch``'s rows and twice them; nothing runs or is allocated.
    ``plan_memory(activation_bytes_per_sample=...)``'s figure for a model of your own.

    ``model``: as ``TrainStep.init`` takes it (an NNX module, abstract ones from
    ``nnx.eval_shape`` too, or a pytree of parameters). ``batch``: one micro-batch's
    arrays or ``jax.ShapeDtypeStruct`` s, rows first. ``remat``: a stage-3 step's
    ``Parallel.remat`` (``"dots"``, ``"full"`` or a ``jax.checkpoint_policies`` policy):
    :func:`jaxdp.scan_layers`' loop over each declared stack under it, as a stage-3 step
    runs it; None: the loop as stages 0 to 2 run it (every activation kept). ``layers``:
    the stacks, as ``Parallel.layers`` declares them (None: the model's "layers"
    sharding metadata). Before XLA's optimizations: fusion
    may recompute cheap values instead of keeping them. ``loss_reduction`` and
    ``has_aux``: ``loss_fn``'s, as :func:`jaxdp.make_train_step` takes them (a
    ``(loss_sum, count)`` loss, a ``(loss, aux)`` one); the residuals are those of the
    loss the step differentiates (the mean, or ``loss_sum``).
    """
    from .._layers import Gather, Route, Stack
    from .._shards import stacked_leaves

    if loss_reduction not in ("mean", "weighted"):
        raise ValueError(f"loss_reduction={loss_reduction!r} must be 'mean' or 'weighted'")
    if not isinstance(has_aux, bool):
        raise ValueError(f"has_aux={has_aux!r} must be True or False")

    graphdef, params, rest = split_model(model)
    stacked = stacked_leaves(params, layers) if remat is not None else []
    # At stage 3 each declared stack reaches scan_layers as the step's Stack, its loop
    # under the remat; nothing is split here (one device, no gather).
    route = Route("gather", "data", 1, gather=Gather("data", 1, remat=remat))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

    def handed(q: Any) -> Any:
        leaves, treedef = jax.tree.flatten(q)
        return treedef.unflatten(
            [
                Stack(x, None, None, None, route, paths[i]) if stacked and stacked[i] else x
                for i, x in enumerate(leaves)
            ]
        )

    def residuals(rows_times: int) -> int:
        rows = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] * rows_times, *x.shape[1:]), x.dtype),
            batch,
        )

        def vjp(p: Any, r: Any, b: Any) -> Any:
            parts = loss_parts(loss_fn, loss_reduction, graphdef, has_aux=has_aux)
            return jax.vjp(lambda q: parts(handed(q), b, *split_state(r), None)[0], p)[1]

        return _nbytes(jax.eval_shape(vjp, params, rest, rows))

    first = jax.tree.leaves(batch)[0].shape[0]
    return (residuals(2) - residuals(1)) / first


def make_optimizer(name: str) -> optax.GradientTransformation:
    """The optax transformation the planner compiles for optimizer ``name``."""
    if name == "adamw":
        return optax.adamw(1e-3)
    if name == "sgd-momentum":
        return optax.sgd(1e-3, momentum=0.9)
    if name == "sgd":
        return optax.sgd(1e-3)
    raise ValueError(f"optimizer={name!r} must be one of ['adamw', 'sgd', 'sgd-momentum']")


class CompiledSteps:
    """Compiles a model's jaxdp step (fused path) for any micro-batch and accumulation.

    The state is built once; each ``compile`` lowers with abstract batches, so
    no batch memory is allocated and large sizes cost nothing but compile time.
    """

    def __init__(self, spec: ModelSpec, optimizer: str, mesh: Mesh):
        self.spec, self.optimizer, self.mesh = spec, optimizer, mesh
        self._state: TrainState | None = None
        self._steps: dict[int, Any] = {}
        self._compiled: dict[tuple[int, int], Any] = {}

    def step(self, accum_steps: int) -> Any:
        if accum_steps not in self._steps:
            self._steps[accum_steps] = make_train_step(
                self.spec.loss,
                make_optimizer(self.optimizer),
                mesh=self.mesh,
                accum_steps=accum_steps,
            )
        return self._steps[accum_steps]

    def state(self) -> TrainState:
        if self._state is None:
            self._state = self.step(1).init(self.spec.make())
        return self._state

    def compile(self, micro_batch_size: int, accum_steps: int = 1) -> Any:
        key = (micro_batch_size, accum_steps)
        if key not in self._compiled:
            self._compiled[key] = self._lower(micro_batch_size, accum_steps).compile()
        return self._compiled[key]

    def _lower(self, micro_batch_size: int, accum_steps: int) -> Any:
        step = self.step(accum_steps)
        rows = self.mesh.devices.size * accum_steps * micro_batch_size
        sharding = NamedSharding(self.mesh, P(self.mesh.axis_names[0]))
        batch = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct((rows, *s.shape[1:]), s.dtype, sharding=sharding),
            self.spec.batch(1),
        )
        step.sizes(batch)
        weights = jax.ShapeDtypeStruct(
            (accum_steps,), jnp.float32, sharding=NamedSharding(self.mesh, P())
        )
        return step.lower(self.state(), batch, weights)

    def memory(self, micro_batch_size: int, accum_steps: int = 1) -> CompiledMemory:
        return compiled_memory(self.compile(micro_batch_size, accum_steps))


@dataclasses.dataclass(frozen=True)
class CompiledChoice:
    """The batch split XLA's analysis allows, with its figures (None: nothing fits)."""

    micro_batch_size: int | None
    accum_steps: int | None
    memory: CompiledMemory  # of the chosen split, or of the smallest one tried
    compiles: int


def choose_micro_batch(
    steps: CompiledSteps, *, usable: float, per_device: int | None, limit: int = 2**24
) -> CompiledChoice:
    """The largest micro-batch whose compiled step needs at most ``usable`` bytes.

    With ``per_device`` (rows per device per optimizer step) the micro-batch
    divides it and ``accum_steps`` completes it; without, ``accum_steps=1``
    and the micro-batch is at most ``limit``. XLA's total is close to affine in
    the micro-batch size (the fused step holds the whole per-device batch
    whatever the split): two compiles fit the line, its prediction is compiled
    to verify, and a miss refits the line through the missed point.
    """
    cap = per_device if per_device is not None else limit

    def candidate(at_most: int) -> int | None:
        if per_device is None:
            return min(at_most, limit) if at_most >= 1 else None
        return largest_divisor_at_most(per_device, at_most)

    def measure(rows: int) -> CompiledMemory:
        return steps.memory(rows, per_device // rows if per_device is not None else 1)

    measured = {rows: measure(rows) for rows in {1, candidate(16)}}
    best = candidate(_predict(measured, usable, cap))
    while best is not None and len(measured) < _MAX_COMPILES:
        if best not in measured:
            measured[best] = measure(best)
        if measured[best].total > usable:
            best = candidate(min(_predict(measured, usable, cap), best - 1))
            continue
        # Verified; one size up must not fit for `best` to be the largest.
        larger = _next_candidate(per_device, best, cap)
        if larger is None or larger in measured or len(measured) == _MAX_COMPILES:
            break
        measured[larger] = measure(larger)
        if measured[larger].total > usable:
            break
        best = candidate(max(larger, _predict(measured, usable, cap)))
    fitting = [rows for rows, memory in measured.items() if memory.total <= usable]
    if not fitting:
        return CompiledChoice(None, None, measured[1], len(measured))
    best = max(fitting)
    return CompiledChoice(best, _accum(per_device, best), measured[best], len(measured))


def _next_candidate(per_device: int | None, rows: int, cap: int) -> int | None:
    if per_device is None:
        return rows + 1 if rows < cap else None
    return min((d for d in divisors(per_device) if d > rows), default=None)


def _accum(per_device: int | None, rows: int) -> int:
    return per_device // rows if per_device is not None else 1


def _predict(measured: dict[int, CompiledMemory], usable: float, cap: int) -> int:
    """Largest rows under ``usable`` on the line through the two largest measured sizes."""
    points = sorted((rows, m.total) for rows, m in measured.items())
    (b0, t0), (b1, t1) = points[-2:] if len(points) > 1 else points * 2
    if b1 == b0 or t1 <= t0:
        return cap if t1 <= usable else b0 - 1
    return int(min(cap, math.floor(b1 + (usable - t1) * (b1 - b0) / (t1 - t0))))


@dataclasses.dataclass(frozen=True)
class LaidOutState:
    """Bytes one device holds of a step's training state, read from the step's own layout
    (``abstract_state``'s shardings: each leaf's shard shape, the most a device holds)."""

    weights: int  # the parameters as they rest (stage 3: the device's blocks)
    gradients: int  # one micro-batch's, in the parameters' dtype, laid out as they rest
    optimizer: int  # the optimizer state
    accumulator: int  # the float32 gradient sums of the accumulation window

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.accumulator


def laid_out_state(
    spec: ModelSpec,
    optimizer: str,
    mesh: Mesh,
    *,
    zero_stage: int,
    model_axes: tuple[str, ...] = (),
) -> LaidOutState:
    """What one device holds of ``spec``'s training state under ``Parallel(zero_stage=...,
    model_axes=...)`` on ``mesh``: the step's ``abstract_state`` (nothing is allocated or
    compiled), each leaf's shard shape times its itemsize. The accumulator is the
    multisteps path's window, laid out as the fused path's loop carries it. The
    gradients rest as the parameters do: split over the model axes as the model says,
    and at stage 3 over the data axis too (a micro-batch's blocks after their
    reduce-scatter; before it, the gathered layer's whole gradients, not counted)."""
    step = make_train_step(
        spec.loss,
        make_optimizer(optimizer),
        mesh=mesh,
        path="multisteps",
        parallel=Parallel(zero_stage=zero_stage, model_axes=model_axes),
    )
    with warnings.catch_warnings():  # stage 3 of a model without a stack says so
        warnings.filterwarnings("ignore", ".*peak memory is not reduced", UserWarning)
        state = step.abstract_state(nnx.eval_shape(spec.make))

    def held(tree: Any) -> int:
        return sum(
            math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(tree)
        )

    weights = held(state.params)
    return LaidOutState(weights, weights, held(state.opt_state), held(state.window.grads))

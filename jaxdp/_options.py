"""A train step's options, checked once, and what follows from them: the accumulator
dtype, the optimizer the state holds, and how each state leaf lies on the mesh."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ._accumulate import multisteps_init
from ._forward import LossReduction
from ._frozen import Trainable, skip_unused, split_trainable, trainable_mask
from ._model_state import BatchStats, wire_dtype
from ._train_state import TrainState
from ._zero import ShardLayout, sharded_leaves, specs_of
from ._zero_optim import on_shards

AccumulationPath = Literal["fused", "multisteps"]
"""``"fused"``: one call per optimizer step; ``"multisteps"``: one call per micro-batch."""

Strategy = Literal["shard_map", "pmap"]
"""How the per-device step is mapped over the mesh: ``jax.shard_map`` or the legacy ``jax.pmap``."""

ZeroStage = Literal[0, 1, 2]
"""0: replicated optimizer state; 1: optimizer state sharded over the data axis; 2: the
gradient accumulator too (docs/semantics.md, "ZeRO")."""


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The arguments of :func:`jaxdp.make_train_step` (see there), after checking."""

    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    mesh: Mesh
    accum_steps: int = 1
    path: AccumulationPath = "fused"
    strategy: Strategy = "shard_map"
    loss_reduction: LossReduction = "mean"
    accum_dtype: Any = None
    donate: bool = True
    batch_stats: BatchStats | None = None
    rng_seed: int | None = None
    trainable: Trainable = None
    skip_unused: bool = False
    skip_nonfinite: bool = True
    max_consecutive_skips: int | None = 10
    zero_stage: ZeroStage = 0
    comm_dtype: Any = None

    def __post_init__(self) -> None:
        _check_objects(self.loss_fn, self.optimizer, self.mesh)
        if not isinstance(self.accum_steps, int) or self.accum_steps < 1:
            raise ValueError(f"accum_steps={self.accum_steps!r} must be a positive integer")
        for name, allowed in (
            ("path", ("fused", "multisteps")),
            ("strategy", ("shard_map", "pmap")),
            ("loss_reduction", ("mean", "weighted")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        if self.batch_stats not in (None, "local", "sync"):
            raise ValueError(f"batch_stats={self.batch_stats!r} must be None, 'local' or 'sync'")
        limit = self.max_consecutive_skips
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"max_consecutive_skips={limit!r} must be a positive integer or None")
        if len(self.mesh.axis_names) != 1:
            raise ValueError(f"mesh must have one (data) axis, got axes {self.mesh.axis_names}")
        _check_zero(self)

    @property
    def comm(self) -> Any:
        """The gradients' dtype on the wire: None (their own) or ``jnp.bfloat16``."""
        return None if self.comm_dtype is None else jnp.dtype(jnp.bfloat16)

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    @property
    def axis_name(self) -> str:
        return self.mesh.axis_names[0]

    @functools.cached_property
    def process_count(self) -> int:
        """Processes whose devices make up the mesh (1 unless multi-process); read
        on every call of the step, so counted once."""
        return len({d.process_index for d in self.mesh.devices.flat})

    def accumulator_dtype(self, params: Any) -> Any:
        """``accum_dtype``, else float64 if any parameter is float64, else float32."""
        if self.accum_dtype is not None:
            return jnp.dtype(self.accum_dtype)
        wide = any(jnp.dtype(x.dtype) == jnp.float64 for x in jax.tree.leaves(params))
        return jnp.dtype(jnp.float64 if wide else jnp.float32)

    def inner_optimizer(self) -> optax.GradientTransformation:
        """The user's optimizer as the step applies it: wrapped by ``skip_unused``; on
        parameter shards (ZeRO) with global-norm clipping made global."""
        if self.zero_stage:
            return on_shards(self.optimizer, self.axis_name)
        return skip_unused(self.optimizer) if self.skip_unused else self.optimizer

    def layout(self, trainable: Any) -> ShardLayout:
        """How the trainable leaves are cut into per-device shards (ZeRO)."""
        return ShardLayout(trainable, self.num_devices)

    def init_opt_state(self, trainable: Any, dtype: Any, batch_stats: Any) -> Any:
        """The optimizer state of ``TrainState.opt_state`` (one copy of any per-device part).

        ``fused``: the user's optimizer's. ``multisteps``: ``optax.MultiSteps``'
        layout (:func:`jaxdp._accumulate.multisteps_init`): the user's
        optimizer's state next to the last synchronized step's metrics, and the
        gradient sums in the accumulator ``dtype``.

        At ZeRO stages the optimizer's state is that of the whole mesh's padded
        shards (:meth:`jaxdp._zero.ShardLayout.padded`), split over the mesh by
        :meth:`opt_specs`; at stage 2 the gradient sums are one device's shard.
        """
        optimizer, sums = self.inner_optimizer(), trainable
        if self.zero_stage:
            layout = self.layout(trainable)
            trainable = layout.padded(trainable)
            sums = layout.shard_like(sums) if self.zero_stage == 2 else sums
        if self.path == "fused":
            return optimizer.init(trainable)
        wire = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, wire_dtype(x.dtype, dtype)), batch_stats
        )
        return multisteps_init(optimizer, trainable, dtype=dtype, extra_like=wire, sums_like=sums)

    def opt_specs(self, opt_state: Any, trainable: Any) -> Any:
        """Mesh layout of the optimizer state: replicated, but MultiSteps' per-device
        ``acc_grads`` (a leading ``num_devices`` axis split over the mesh) and, at
        ZeRO stages, the optimizer's per-parameter state (split over the mesh)."""
        specs = jax.tree.map(lambda _: P(), opt_state)
        inner = None
        if self.zero_stage:
            layout = self.layout(trainable)
            flags = sharded_leaves(self.inner_optimizer().init, layout, trainable)
            inner = specs_of(flags, self.axis_name)
        if self.path == "fused":
            return specs if inner is None else inner
        if inner is not None:
            specs = specs._replace(inner_opt_state=(specs.inner_opt_state[0], inner))
        return specs._replace(
            acc_grads=jax.tree.map(lambda _: P(self.axis_name), opt_state.acc_grads)
        )

    def state_specs(self, state: TrainState) -> TrainState:
        """Mesh layout of every state leaf (the per-device accumulators split, the rest
        replicated)."""

        def replicated(tree: Any) -> Any:
            return jax.tree.map(lambda _: P(), tree)

        accum = state.accum
        if accum is not None:
            accum = jax.tree.map(lambda _: P(self.axis_name), accum)
        trainable = split_trainable(state.params, trainable_mask(state.params, self.trainable))
        return TrainState(
            P(),
            replicated(state.params),
            self.opt_specs(state.opt_state, trainable),
            accum,
            state.graphdef,
            replicated(state.model_state),
            P(),
            P(),
        )


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


def _check_zero(o: StepOptions) -> None:
    """``zero_stage`` and ``comm_dtype`` in range, and only where they apply."""
    if o.zero_stage not in (0, 1, 2) or isinstance(o.zero_stage, bool):
        raise ValueError(f"zero_stage={o.zero_stage!r} must be 0, 1 or 2")
    if o.comm_dtype is not None and jnp.dtype(o.comm_dtype) != jnp.bfloat16:
        raise ValueError(
            f"comm_dtype={o.comm_dtype!r} must be None (gradients travel in the accumulator "
            "dtype) or 'bfloat16'"
        )
    if o.zero_stage and o.strategy == "pmap":
        raise ValueError(
            f"zero_stage={o.zero_stage} needs strategy='shard_map' (the legacy pmap strategy "
            "keeps the optimizer state replicated); use strategy='shard_map' or zero_stage=0"
        )
    if o.zero_stage and o.skip_unused:
        raise ValueError(
            f"zero_stage={o.zero_stage} cannot be combined with skip_unused=True (a shard "
            "does not see whether its whole parameter's gradient is zero); use zero_stage=0"
        )

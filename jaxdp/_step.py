"""The data-parallel train step builder."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._accumulate import AccumState, fused_update, multisteps_update
from ._layout import BatchSizes, call_sizes
from ._mesh import place
from ._model import LossReduction, loss_parts, merge_model, micro_forward, split_model
from ._state import BatchStats, check_batch_stats, configure, split_state, wire_dtype
from ._sync import check_replicas, mark_varying, sync_on_emit
from ._train_state import SkipWatch, TrainState, advance
from ._trainable import Trainable, combine, skip_unused, split_trainable, trainable_mask

AccumulationPath = Literal["fused", "multisteps"]
Strategy = Literal["shard_map", "pmap"]


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A compiled data-parallel training step; build it with :func:`make_train_step`.

    ``init(params_or_module)`` places the state on the mesh; ``step(state,
    batch)`` returns ``(new_state, metrics)``. The ``fused`` path takes a global
    batch of ``num_devices * accum_steps * micro_batch_size`` rows per call and
    applies one update; ``multisteps`` takes one global micro-batch of
    ``num_devices * micro_batch_size`` rows per call and applies an update on
    every ``accum_steps``-th call (``metrics["emitted"]``). On a mesh spanning
    several processes each process passes only its rows of that batch
    (:func:`process_share`); ``jax.make_array_from_process_local_data``
    assembles the global array, and no process holds the whole batch.
    """

    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    mesh: Mesh
    accum_steps: int
    path: AccumulationPath
    strategy: Strategy
    loss_reduction: LossReduction
    accum_dtype: Any
    donate: bool
    batch_stats: BatchStats | None = None
    rng_seed: int | None = None
    trainable: Trainable = None
    skip_unused: bool = False
    skip_nonfinite: bool = True
    max_consecutive_skips: int | None = 10
    _jitted: Callable[..., Any] = dataclasses.field(init=False, repr=False)
    _watch: SkipWatch = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        donate = (0,) if self.donate else ()
        object.__setattr__(self, "_jitted", jax.jit(self._global_step, donate_argnums=donate))
        limit = self.max_consecutive_skips if self.skip_nonfinite else None
        cpu = self.num_devices > 1 and self.mesh.devices.flat[0].platform == "cpu"
        object.__setattr__(self, "_watch", SkipWatch(limit, bound=cpu))

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    @property
    def axis_name(self) -> str:
        return self.mesh.axis_names[0]

    # ---- state ----------------------------------------------------------------

    def init(self, params_or_module: Any) -> TrainState:
        """Replicates params (or an NNX module's) and builds the optimizer state.

        Checks that every replica holds the same parameters (raises
        :class:`ReplicaMismatchError` naming the first differing leaf), that
        ``batch_stats`` fits the model's BatchNorm modules, and ``trainable``
        its parameters. The optimizer state covers trainable parameters only.
        """
        check_batch_stats(params_or_module, self.batch_stats, self.axis_name)
        graphdef, params, model_state = split_model(params_or_module)
        if self.batch_stats is not None and graphdef is None:
            raise ValueError("batch_stats needs an NNX module with BatchNorm, got a pytree")
        replicated = NamedSharding(self.mesh, P())
        params = place(params, replicated, copy=self.donate)
        model_state = place(model_state, replicated, copy=self.donate)
        check_replicas(params, self.mesh, name="params")
        mask = trainable_mask(params, self.trainable)
        dtype = self._dtype(params)
        stats = split_state(model_state)[0]
        opt = self._optimizer(dtype, stats)
        # step, skipped_steps, consecutive_skips: three buffers, each donated once.
        step, *counters = (jax.device_put(jnp.zeros([], jnp.int32), replicated) for _ in range(3))

        def init_fused(params):
            return opt.init(split_trainable(params, mask))

        if self.path == "fused":
            opt_state = jax.jit(init_fused, out_shardings=replicated)(params)
            return TrainState(step, params, opt_state, None, graphdef, model_state, *counters)
        per_device = NamedSharding(self.mesh, P(self.axis_name))

        def stack(tree):
            return jax.tree.map(lambda x: jnp.zeros((self.num_devices, *x.shape), x.dtype), tree)

        def init_multisteps(params):
            state = init_fused(params)
            return state._replace(acc_grads=stack(state.acc_grads))

        specs = self._opt_specs(jax.eval_shape(init_multisteps, params))
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)
        opt_state = jax.jit(init_multisteps, out_shardings=shardings)(params)
        accum = AccumState(
            *(jax.device_put(jnp.zeros([self.num_devices], dtype), per_device) for _ in range(2)),
            jax.jit(stack, out_shardings=per_device)(stats),
        )
        return TrainState(step, params, opt_state, accum, graphdef, model_state, *counters)

    def model(self, state: TrainState) -> Any:
        """The trained parameters, or the NNX module with them merged in."""
        return merge_model(state.graphdef, state.params, state.model_state)

    # ---- stepping ---------------------------------------------------------------

    def __call__(
        self, state: TrainState, batch: Any, micro_weights: Any = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """One call: ``(new_state, metrics)``.

        ``micro_weights`` weighs the call's micro-batches (``fused``: one value
        per micro-batch, shape ``[accum_steps]``; ``multisteps``: a scalar);
        default all ones. A micro-batch of weight 0 adds nothing: that is how
        padding fills an incomplete last window (:func:`epoch_schedule`).

        Raises :class:`NonFiniteError`, before using this call's batch, when
        the call two before this one had reached ``max_consecutive_skips``
        skipped updates in a row and ``state`` (from the call just before) still
        continues that run (:meth:`check`).
        """
        inputs = self._inputs(batch, micro_weights)
        self._watch.before(state)
        state, metrics = self._jitted(state, *inputs)
        self._watch.after(metrics)
        return state, metrics

    def check(self, state: TrainState) -> None:
        """Raises :class:`NonFiniteError` if ``state`` follows ``max_consecutive_skips``
        skipped updates in a row (a host read: it waits for the call that made it).

        Every call watches the calls before it; check the last call's state
        after a loop, or a limit reached by the last calls goes unreported.
        """
        self._watch.check(state)

    def compile(self, state: TrainState, batch: Any, micro_weights: Any = None) -> Any:
        """The compiled step for these shapes (for :func:`all_reduces`, memory analysis)."""
        return self._jitted.lower(state, *self._inputs(batch, micro_weights)).compile()

    def _inputs(self, batch: Any, micro_weights: Any) -> tuple[Any, jax.Array]:
        shape = (self.accum_steps,) if self.path == "fused" else ()
        if micro_weights is None:
            micro_weights = np.ones(shape)
        micro_weights = np.asarray(micro_weights, np.float32)  # 0 and 1 are exact
        if micro_weights.shape != shape:
            raise ValueError(
                f"micro_weights has shape {micro_weights.shape}; the {self.path} path takes "
                f"shape {shape} (one weight per micro-batch of the call)"
            )
        replicated = NamedSharding(self.mesh, P())
        return self._split_batch(batch), place(micro_weights, replicated)

    def _split_batch(self, batch: Any) -> Any:
        """Checks the batch identity, then splits the rows over the mesh."""
        self.sizes(batch)
        return place(batch, NamedSharding(self.mesh, P(self.axis_name)))

    @property
    def process_count(self) -> int:
        """Processes whose devices make up the mesh (1 unless multi-process)."""
        return len({d.process_index for d in self.mesh.devices.flat})

    def sizes(self, batch: Any) -> BatchSizes:
        """The (global) batch identity of a batch for one call of this step; raises
        if it does not fit (:func:`jaxdp._layout.call_sizes`)."""
        return call_sizes(
            batch,
            path=self.path,
            num_devices=self.num_devices,
            accum_steps=self.accum_steps,
            process_count=self.process_count,
        )

    def _global_step(self, state: TrainState, batch: Any, micro_weights: jax.Array):
        specs = self._state_specs(state)
        if self.strategy == "pmap":
            axes = jax.tree.map(
                lambda s: None if s == P() else 0, specs, is_leaf=lambda x: isinstance(x, P)
            )
            batch = jax.tree.map(lambda x: x.reshape(self.num_devices, -1, *x.shape[1:]), batch)
            mapped = jax.pmap(
                self._local_step,
                self.axis_name,
                in_axes=(axes, 0, None),
                out_axes=(axes, None),
                devices=list(self.mesh.devices.flat),
            )
            return mapped(state, batch, micro_weights)
        data = P(self.axis_name)

        def local(state, batch, micro_weights):
            # Per-device leaves arrive as this device's [1, ...] block.
            state = _map_per_device(state, lambda x: x[0])
            state, metrics = self._local_step(state, batch, micro_weights)
            return _map_per_device(state, lambda x: x[None]), metrics

        mapped = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(specs, data, P()),
            out_specs=(specs, P()),
            check_vma=True,
        )
        return mapped(state, batch, micro_weights)

    def _local_step(self, state: TrainState, batch: Any, micro_weights: jax.Array):
        """One device's step; per-device leaves arrive without their device axis."""
        dtype = self._dtype(state.params)
        mask = trainable_mask(state.params, self.trainable)
        stats = split_state(state.model_state)[0]
        if self.strategy == "shard_map":
            to_varying = functools.partial(mark_varying, axis_name=self.axis_name)
        else:
            to_varying = _identity  # pmap does not track replication
        common = dict(
            forward=micro_forward(
                loss_parts(
                    self.loss_fn,
                    self.loss_reduction,
                    state.graphdef,
                    configure=functools.partial(
                        configure, mode=self.batch_stats, axis_name=self.axis_name
                    ),
                    with_rng=self.rng_seed is not None,
                ),
                state.params,
                mask,
                state.model_state,
                state.step,
                axis_name=self.axis_name,
                rng_seed=self.rng_seed,
            ),
            optimizer=self._optimizer(dtype, stats),
            params=split_trainable(state.params, mask),
            opt_state=state.opt_state,
            axis_name=self.axis_name,
            dtype=dtype,
            to_varying=to_varying,
            skip_nonfinite=self.skip_nonfinite,
        )
        accum = state.accum
        if self.path == "fused":
            micro = jax.tree.map(lambda x: x.reshape(self.accum_steps, -1, *x.shape[1:]), batch)
            update = fused_update(
                **common, batch_stats=stats, micro_batches=micro, micro_weights=micro_weights
            )
        else:
            update, accum = multisteps_update(
                **common,
                accum=state.accum,
                batch_stats=stats,
                batch=batch,
                micro_weight=micro_weights,
                accum_steps=self.accum_steps,
            )
        return advance(state, update, combine(update.params, state.params, mask), accum)

    # ---- helpers ----------------------------------------------------------------

    def _dtype(self, params: Any) -> Any:
        if self.accum_dtype is not None:
            return jnp.dtype(self.accum_dtype)
        wide = any(jnp.dtype(x.dtype) == jnp.float64 for x in jax.tree.leaves(params))
        return jnp.dtype(jnp.float64 if wide else jnp.float32)

    def _optimizer(self, dtype: Any, batch_stats: Any) -> optax.GradientTransformation:
        optimizer = skip_unused(self.optimizer) if self.skip_unused else self.optimizer
        if self.path == "fused":
            return optimizer
        wire = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, wire_dtype(x.dtype, dtype)), batch_stats
        )
        sync = sync_on_emit(self.axis_name, dtype=dtype, extra_like=wire, inner=optimizer)
        return optax.MultiSteps(
            sync,
            self.accum_steps,
            use_grad_mean=False,
            accumulator_dtype=dtype,
        )

    def _opt_specs(self, opt_state: Any) -> Any:
        if self.path == "fused":
            return jax.tree.map(lambda _: P(), opt_state)
        specs = jax.tree.map(lambda _: P(), opt_state)
        return specs._replace(
            acc_grads=jax.tree.map(lambda _: P(self.axis_name), opt_state.acc_grads)
        )

    def _state_specs(self, state: TrainState) -> TrainState:
        def replicated(tree):
            return jax.tree.map(lambda _: P(), tree)

        accum = state.accum
        if accum is not None:
            accum = jax.tree.map(lambda _: P(self.axis_name), accum)
        return TrainState(
            P(),
            replicated(state.params),
            self._opt_specs(state.opt_state),
            accum,
            state.graphdef,
            replicated(state.model_state),
            P(),
            P(),
        )


def _identity(x: Any) -> Any:
    return x


def _map_per_device(state: TrainState, fn: Callable[[Any], Any]) -> TrainState:
    if state.accum is None:
        return state
    opt_state = state.opt_state._replace(acc_grads=jax.tree.map(fn, state.opt_state.acc_grads))
    return state._replace(opt_state=opt_state, accum=jax.tree.map(fn, state.accum))


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh,
    accum_steps: int = 1,
    path: AccumulationPath = "fused",
    strategy: Strategy = "shard_map",
    loss_reduction: LossReduction = "mean",
    accum_dtype: Any = None,
    donate: bool = True,
    batch_stats: BatchStats | None = None,
    rng_seed: int | None = None,
    trainable: Trainable = None,
    skip_unused: bool = False,
    skip_nonfinite: bool = True,
    max_consecutive_skips: int | None = 10,
) -> TrainStep:
    """Builds a data-parallel step with gradient accumulation.

    Args:
      loss_fn: ``loss_fn(params, micro_batch)`` (or ``loss_fn(module, ...)`` when
        :meth:`TrainStep.init` gets an NNX module). Returns the micro-batch's
        mean loss (``loss_reduction="mean"``) or ``(loss_sum, count)``
        (``"weighted"``).
      optimizer: any optax transformation; jaxdp applies it once per step.
      mesh: a one-axis mesh (:func:`data_mesh`); the batch is split over it.
      accum_steps: micro-batches per device per optimizer step.
      path: ``"fused"`` (one call per step, ``lax.scan`` over micro-batches) or
        ``"multisteps"`` (one call per micro-batch, ``optax.MultiSteps``).
      strategy: ``"shard_map"`` or the legacy ``"pmap"``.
      loss_reduction: ``"mean"``: the update follows the mean of the
        ``num_devices * accum_steps`` micro-batch means (DDP with ``loss /
        accum_steps``). ``"weighted"``: it follows ``sum of loss_sum / sum of
        count`` over all micro-batches and devices, exact for unequal counts.
      accum_dtype: accumulator dtype for gradients, loss and weights; default
        float64 if any parameter is float64, else float32.
      donate: donate the input state's buffers to the output (saves memory;
        the state passed in must not be used again).
      batch_stats: how BatchNorm modules (``nnx.BatchStat`` variables and an
        ``axis_name``) compute statistics; required when the model has any.
        ``"local"``: each device normalizes with its own micro-batch's
        statistics and the running statistics kept are device 0's (DDP with
        ``broadcast_buffers=True``). ``"sync"``: statistics over the
        micro-batch of every device (SyncBatchNorm; jaxdp sets the modules'
        ``axis_name``), at the cost of collectives in every micro-batch's
        forward and backward. Either way the running statistics update once
        per micro-batch.
      rng_seed: if set, ``loss_fn`` is called with the keyword ``rng``, a key
        derived from this seed like the NNX streams' (below).
      trainable: which parameters train (default all): a pytree of bools, a
        predicate ``(path, value) -> bool`` or an NNX filter. Frozen ones get
        no gradient, no all-reduce bytes, no optimizer state and no update.
      skip_unused: a parameter whose all-reduced gradient is exactly zero (not
        used by any device's micro-batches) takes no optimizer step, like
        torch skips parameters whose ``.grad`` is None; its momentum and
        moments keep their values (state shared across parameters, such as
        Adam's step count, still advances).
      skip_nonfinite: if the all-reduced gradients or loss hold a NaN or Inf
        (from any device), skip the update on every device: parameters,
        optimizer state and batch statistics stay, the step count does not
        advance, the accumulation window restarts; ``metrics["skipped"]``,
        ``"skipped_steps"`` and ``"consecutive_skips"`` count them.
      max_consecutive_skips: raise :class:`NonFiniteError`, before a call uses
        its batch, once the skip counter of the call two before it reached this
        many updates skipped in a row and the state the call is given still
        holds that run (None: never). Watched on the host two calls behind, so
        at most two calls are in flight and the host is not synced every call;
        :meth:`TrainStep.check` tests a state at once.

    Gradients travel in one all-reduce per optimizer step, issued after the
    last micro-batch (``no_sync`` on the others), together with the loss and
    weight sums and device 0's batch statistics.

    Randomness: each micro-batch re-keys every ``nnx.Rngs`` stream of the
    module as ``fold_in(fold_in(fold_in(stream_key, step), device),
    micro_batch)`` with ``step`` the updates applied so far, ``device`` the
    global mesh index and ``micro_batch`` the index in the window: masks differ
    across devices and micro-batches and do not depend on how many processes
    share the mesh.
    """
    if not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps!r} must be a positive integer")
    for name, value, allowed in (
        ("path", path, ("fused", "multisteps")),
        ("strategy", strategy, ("shard_map", "pmap")),
        ("loss_reduction", loss_reduction, ("mean", "weighted")),
    ):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} must be one of {allowed}")
    if batch_stats not in (None, "local", "sync"):
        raise ValueError(f"batch_stats={batch_stats!r} must be None, 'local' or 'sync'")
    if max_consecutive_skips is not None and (
        not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 1
    ):
        raise ValueError(
            f"max_consecutive_skips={max_consecutive_skips!r} must be a positive integer or None"
        )
    if len(mesh.axis_names) != 1:
        raise ValueError(f"mesh must have one (data) axis, got axes {mesh.axis_names}")
    return TrainStep(
        loss_fn,
        optimizer,
        mesh,
        accum_steps,
        path,
        strategy,
        loss_reduction,
        accum_dtype,
        donate,
        batch_stats=batch_stats,
        rng_seed=rng_seed,
        trainable=trainable,
        skip_unused=skip_unused,
        skip_nonfinite=skip_nonfinite,
        max_consecutive_skips=max_consecutive_skips,
    )

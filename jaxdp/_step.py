"""The data-parallel train step builder."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._accumulate import AccumState, fused_update, learning_rate, multisteps_update
from ._layout import BatchSizes, batch_sizes
from ._model import LossReduction, loss_parts, merge_model, split_model
from ._sync import check_replicas, mark_varying, sync_on_emit

AccumulationPath = Literal["fused", "multisteps"]
Strategy = Literal["shard_map", "pmap"]


class TrainState(NamedTuple):
    """Everything one optimizer step reads and writes.

    Replicated on every device, except the per-device accumulators of the
    ``multisteps`` path (``accum`` and MultiSteps' ``acc_grads``), which carry
    a leading ``num_devices`` axis split over the mesh.
    """

    step: jax.Array  # optimizer updates applied so far
    params: Any
    opt_state: Any
    accum: AccumState | None  # multisteps only
    graphdef: Any  # NNX graph definition (static), None for a plain pytree
    model_state: Any  # NNX non-parameter variables, None for a plain pytree


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
    _jitted: Callable[..., Any] = dataclasses.field(init=False, repr=False)
    _in_flight: list[Any] = dataclasses.field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        donate = (0,) if self.donate else ()
        object.__setattr__(self, "_jitted", jax.jit(self._global_step, donate_argnums=donate))

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
        :class:`ReplicaMismatchError` naming the first differing leaf).
        """
        graphdef, params, model_state = split_model(params_or_module)
        replicated = NamedSharding(self.mesh, P())
        params = _place(params, replicated, copy=self.donate)
        model_state = _place(model_state, replicated, copy=self.donate)
        check_replicas(params, self.mesh, name="params")
        dtype = self._dtype(params)
        opt = self._optimizer(dtype)
        step = jax.device_put(jnp.zeros([], jnp.int32), replicated)
        if self.path == "fused":
            opt_state = jax.jit(opt.init, out_shardings=replicated)(params)
            return TrainState(step, params, opt_state, None, graphdef, model_state)
        per_device = NamedSharding(self.mesh, P(self.axis_name))

        def init_multisteps(params):
            state = opt.init(params)
            stacked = jax.tree.map(
                lambda x: jnp.zeros((self.num_devices, *x.shape), x.dtype), state.acc_grads
            )
            return state._replace(acc_grads=stacked)

        specs = self._opt_specs(jax.eval_shape(init_multisteps, params))
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)
        opt_state = jax.jit(init_multisteps, out_shardings=shardings)(params)
        accum = AccumState(
            *(
                jax.device_put(jnp.zeros([self.num_devices], dtype), per_device)
                for _ in AccumState._fields
            )
        )
        return TrainState(step, params, opt_state, accum, graphdef, model_state)

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
        """
        inputs = self._inputs(batch, micro_weights)
        if self._in_flight:
            # Emulated CPU devices run their collectives on a shared thread pool;
            # dozens of queued steps on 2 cores starved XLA's in-process
            # all-reduce until its rendezvous timeout aborted the process
            # (docs/decisions.md). One call in flight still overlaps the host's
            # next batch with this step's compute.
            jax.block_until_ready(self._in_flight.pop())
        new_state, metrics = self._jitted(state, *inputs)
        if self.num_devices > 1 and self.mesh.devices.flat[0].platform == "cpu":
            self._in_flight.append(metrics)
        return new_state, metrics

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
        return self._split_batch(batch), _place(micro_weights, replicated)

    def _split_batch(self, batch: Any) -> Any:
        """Checks the batch identity, then splits the rows over the mesh."""
        self.sizes(batch)
        return _place(batch, NamedSharding(self.mesh, P(self.axis_name)))

    @property
    def process_count(self) -> int:
        """Processes whose devices make up the mesh (1 unless multi-process)."""
        return len({d.process_index for d in self.mesh.devices.flat})

    def sizes(self, batch: Any) -> BatchSizes:
        """The (global) batch identity of a batch for this step; raises if it does not fit.

        With several processes, ``batch`` is this process's part: its rows of the
        device-major global batch (:func:`process_share`), the same number on
        every process, so the global batch has ``process_count`` times as many.
        """
        rows = {np.shape(x)[0] if np.ndim(x) else 0 for x in jax.tree.leaves(batch)}
        if len(rows) != 1:
            raise ValueError(f"every batch leaf needs the same leading size, got {sorted(rows)}")
        (rows,) = rows
        total = rows * self.process_count
        try:
            if self.path == "fused":
                return batch_sizes(
                    num_devices=self.num_devices,
                    accum_steps=self.accum_steps,
                    global_batch_size=total,
                )
            if total < 1 or total % self.num_devices:
                raise ValueError(
                    f"a multisteps call takes one global micro-batch of num_devices * "
                    f"micro_batch_size rows: {total} rows must be a positive multiple of "
                    f"num_devices={self.num_devices} (the accum_steps={self.accum_steps} "
                    "micro-batches of a step come in separate calls)"
                )
            return batch_sizes(
                num_devices=self.num_devices,
                accum_steps=self.accum_steps,
                micro_batch_size=total // self.num_devices,
            )
        except ValueError as e:
            if self.process_count == 1:
                raise
            raise ValueError(
                f"this process's batch has {rows} rows; {self.process_count} processes make "
                f"a global batch of {total} rows: {e}"
            ) from None

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
        parts = loss_parts(self.loss_fn, self.loss_reduction, state.graphdef, state.model_state)
        dtype = self._dtype(state.params)
        if self.strategy == "shard_map":
            to_varying = functools.partial(mark_varying, axis_name=self.axis_name)
        else:
            to_varying = _identity  # pmap does not track replication
        if self.path == "fused":
            micro = jax.tree.map(lambda x: x.reshape(self.accum_steps, -1, *x.shape[1:]), batch)
            params, opt_state, metrics = fused_update(
                parts,
                self._optimizer(dtype),
                state.params,
                state.opt_state,
                micro,
                micro_weights,
                axis_name=self.axis_name,
                dtype=dtype,
                to_varying=to_varying,
            )
            step, accum = state.step + 1, state.accum
        else:
            params, opt_state, accum, metrics = multisteps_update(
                parts,
                self._optimizer(dtype),
                state.params,
                state.opt_state,
                state.accum,
                batch,
                micro_weights,
                accum_steps=self.accum_steps,
                dtype=dtype,
                to_varying=to_varying,
            )
            step = state.step + metrics["emitted"].astype(state.step.dtype)
        lr = learning_rate(opt_state)
        if lr is not None:
            metrics["learning_rate"] = lr
        return state._replace(step=step, params=params, opt_state=opt_state, accum=accum), metrics

    # ---- helpers ----------------------------------------------------------------

    def _dtype(self, params: Any) -> Any:
        if self.accum_dtype is not None:
            return jnp.dtype(self.accum_dtype)
        wide = any(jnp.dtype(x.dtype) == jnp.float64 for x in jax.tree.leaves(params))
        return jnp.dtype(jnp.float64 if wide else jnp.float32)

    def _optimizer(self, dtype: Any) -> optax.GradientTransformation:
        if self.path == "fused":
            return self.optimizer
        inner = optax.chain(sync_on_emit(self.axis_name, dtype=dtype), self.optimizer)
        return optax.MultiSteps(
            inner, self.accum_steps, use_grad_mean=False, accumulator_dtype=dtype
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

        accum = None if state.accum is None else AccumState(P(self.axis_name), P(self.axis_name))
        return TrainState(
            P(),
            replicated(state.params),
            self._opt_specs(state.opt_state),
            accum,
            state.graphdef,
            replicated(state.model_state),
        )


def _identity(x: Any) -> Any:
    return x


def _map_per_device(state: TrainState, fn: Callable[[Any], Any]) -> TrainState:
    if state.accum is None:
        return state
    opt_state = state.opt_state._replace(acc_grads=jax.tree.map(fn, state.opt_state.acc_grads))
    return state._replace(opt_state=opt_state, accum=jax.tree.map(fn, state.accum))


def _place(tree: Any, sharding: NamedSharding, *, copy: bool = False) -> Any:
    """Puts host or device values on the mesh with ``sharding``.

    Host values are each process's local data (for a replicated sharding: the
    whole value), so this works unchanged across processes. ``copy`` gives
    device values fresh buffers, so donating the result never deletes arrays
    the caller still holds.
    """

    def place(x: Any) -> Any:
        if isinstance(x, jax.Array):
            if not copy and x.sharding.is_equivalent_to(sharding, x.ndim):
                return x
            # Not device_put(may_alias=False): it still reuses the buffer of a
            # shard that stays on the same device (jax 0.10.2).
            return jax.jit(jnp.copy, out_shardings=sharding)(x)
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree.map(place, tree)


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

    Gradients travel in one all-reduce per optimizer step, issued after the
    last micro-batch (``no_sync`` on the others), together with the loss and
    weight sums.
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
    if len(mesh.axis_names) != 1:
        raise ValueError(f"mesh must have one (data) axis, got axes {mesh.axis_names}")
    return TrainStep(
        loss_fn, optimizer, mesh, accum_steps, path, strategy, loss_reduction, accum_dtype, donate
    )

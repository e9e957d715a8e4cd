"""One call of the step as the devices run it: mapped over the mesh, then per device in
four named stages.

1. :func:`_differentiated`: the trainable parameters, the frozen mask, the
   batch statistics and the accumulator dtype of this state;
2. :func:`_forward`: one micro-batch's loss and gradients on this device (the
   BatchNorm mode, the rng streams re-keyed per step, device and micro-batch);
3. :func:`_update`: accumulate the micro-batches, all-reduce once, apply the
   optimizer or skip a non-finite update (``fused`` or ``multisteps``);
4. :func:`jaxdp._train_state.advance`: the new state and the metrics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from ._accumulate import AccumState, Forward, StepEnd, Update, fused_update, multisteps_update
from ._forward import loss_parts, micro_forward
from ._frozen import combine, split_trainable, trainable_mask
from ._model_state import configure, split_state
from ._options import StepOptions
from ._sync import mark_varying
from ._train_state import TrainState, advance
from ._zero_step import ShardedEnd


def global_step(
    options: StepOptions, state: TrainState, batch: Any, micro_weights: jax.Array
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The whole mesh's call: :func:`device_step` mapped with ``shard_map`` or ``pmap``.

    The batch is split over the mesh by rows; the per-device accumulators of
    the multisteps path by their leading axis; everything else is replicated.
    """
    specs = options.state_specs(state)
    step = functools.partial(device_step, options)
    if options.strategy == "pmap":
        axes = jax.tree.map(
            lambda s: None if s == P() else 0, specs, is_leaf=lambda x: isinstance(x, P)
        )
        n = options.num_devices
        batch = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
        mapped = jax.pmap(
            step,
            options.axis_name,
            in_axes=(axes, 0, None),
            out_axes=(axes, None),
            devices=list(options.mesh.devices.flat),
        )
        # The gradient sums reach each device as a [1, ...] block, as under shard_map.
        state, metrics = mapped(_sums(state, lambda x: x[:, None]), batch, micro_weights)
        return _sums(state, lambda x: x[:, 0]), metrics

    def local(state: TrainState, batch: Any, micro_weights: jax.Array):
        # Per-device leaves arrive as this device's [1, ...] block.
        state, metrics = step(_per_device(state, lambda x: x[0]), batch, micro_weights)
        return _per_device(state, lambda x: x[None]), metrics

    mapped = jax.shard_map(
        local,
        mesh=options.mesh,
        in_specs=(specs, P(options.axis_name), P()),
        out_specs=(specs, P()),
        check_vma=True,
    )
    return mapped(state, batch, micro_weights)


def device_step(
    options: StepOptions, state: TrainState, batch: Any, micro_weights: jax.Array
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One device's call on its rows; per-device leaves arrive without their device axis."""
    parts = _differentiated(options, state)
    forward = _forward(options, state, parts)
    update, accum = _update(options, state, parts, forward, batch, micro_weights)
    return advance(state, update, combine(update.params, state.params, parts.mask), accum)


class _Parts(NamedTuple):
    """What one call differentiates, accumulates and updates."""

    trainable: Any  # the parameters with frozen leaves replaced by optax.MaskedNode()
    mask: tuple[bool, ...]  # per parameter leaf: trains
    batch_stats: Any  # the committed nnx.BatchStat values (None without any)
    dtype: Any  # of the gradient, loss and weight accumulators


def _differentiated(options: StepOptions, state: TrainState) -> _Parts:
    mask = trainable_mask(state.params, options.trainable)
    return _Parts(
        split_trainable(state.params, mask),
        mask,
        split_state(state.model_state)[0],
        options.accumulator_dtype(state.params),
    )


def _forward(options: StepOptions, state: TrainState, parts: _Parts) -> Forward:
    parts_of_loss = loss_parts(
        options.loss_fn,
        options.loss_reduction,
        state.graphdef,
        configure=functools.partial(
            configure, mode=options.batch_stats, axis_name=options.axis_name
        ),
        with_rng=options.rng_seed is not None,
    )
    return micro_forward(
        parts_of_loss,
        state.params,
        parts.mask,
        state.model_state,
        state.step,
        axis_name=options.axis_name,
        rng_seed=options.rng_seed,
    )


def _update(
    options: StepOptions,
    state: TrainState,
    parts: _Parts,
    forward: Forward,
    batch: Any,
    micro_weights: jax.Array,
) -> tuple[Update, AccumState | None]:
    end = _end(options, parts)
    common = dict(
        forward=forward,
        optimizer=options.inner_optimizer(),
        params=parts.trainable,
        opt_state=state.opt_state,
        batch_stats=parts.batch_stats,
        end=end,
        to_varying=_to_varying(options),
        micro_sync=end.micro_sync if options.zero_stage == 2 else None,
    )
    if options.path == "fused":
        k = options.accum_steps
        micro = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), batch)
        return fused_update(**common, micro_batches=micro, micro_weights=micro_weights), None
    return multisteps_update(
        **common,
        accum=state.accum,
        batch=batch,
        micro_weight=micro_weights,
        accum_steps=options.accum_steps,
    )


def _end(options: StepOptions, parts: _Parts) -> StepEnd | ShardedEnd:
    """The step's end: one all-reduce (stage 0), or reduce-scatter, the optimizer on
    this device's shard and all-gather (ZeRO stages 1 and 2)."""
    common = (options.axis_name, parts.dtype, options.skip_nonfinite)
    if options.zero_stage:
        layout = options.layout(parts.trainable)
        rest = (options.zero_stage, options.comm, options.num_devices)
        return ShardedEnd(*common, layout, *rest)
    return StepEnd(*common, options.comm, options.num_devices)


def _to_varying(options: StepOptions) -> Callable[[Any], Any]:
    """Marks replicated values per-device (shard_map); pmap does not track replication."""
    if options.strategy == "shard_map":
        return functools.partial(mark_varying, axis_name=options.axis_name)
    return _identity


def _identity(x: Any) -> Any:
    return x


def _per_device(state: TrainState, fn: Callable[[Any], Any]) -> TrainState:
    """``fn`` on the multisteps path's per-device window state, not on its gradient
    sums: they keep their [1, ...] block, the shape they are updated in place in."""
    if state.accum is None:
        return state
    return state._replace(accum=jax.tree.map(fn, state.accum))


def _sums(state: TrainState, fn: Callable[[Any], Any]) -> TrainState:
    if state.accum is None:
        return state
    acc = jax.tree.map(fn, state.opt_state.acc_grads)
    return state._replace(opt_state=state.opt_state._replace(acc_grads=acc))

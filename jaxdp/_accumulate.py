"""Per-device step bodies: fused accumulation and the MultiSteps path.

Both run inside ``shard_map`` (or ``pmap``) on ONE device's data and state and
communicate only through one psum per optimizer step
(:func:`jaxdp._sync.all_reduce_sums`). They accumulate per-device SUMS of
micro-batch gradients, losses and weights, and divide by the global weight
after the all-reduce. Device 0's batch statistics ride in the same psum, and
the finiteness of its result decides, identically on every device, whether
the update is applied or skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._model_state import device0, from_wire
from ._sync import SyncState, all_finite, all_reduce_sums, mean_grads

Forward = Callable[[Any, Any, Any, jax.Array, jax.Array], tuple[Any, jax.Array, jax.Array, Any]]
"""``forward(params, micro_batch, batch_stats, micro_index, scale) -> (grads, value,
weight, new_batch_stats)`` of one micro-batch on one device, the loss times ``scale``."""


class AccumState(NamedTuple):
    """Per-device state of the open accumulation window (``multisteps`` path)."""

    loss_sum: jax.Array
    weight: jax.Array
    # The batch statistics each device carries between the window's micro-batches;
    # unused (zeros) at a window boundary, where every device starts from the
    # committed ones.
    batch_stats: Any = None


class Update(NamedTuple):
    params: Any
    opt_state: Any
    batch_stats: Any
    applied: jax.Array  # an update was applied (not skipped, and emitted on multisteps)
    skipped: jax.Array  # an update was due but skipped: non-finite gradients or loss
    metrics: dict[str, jax.Array]


def _scaled(forward: Forward, params, batch, stats, index, scale, dtype):
    """Gradient, value and weight of one micro-batch, each times ``scale``.

    ``scale`` is the micro-batch's weight in its window: 1, or 0 for a padding
    micro-batch that fills an incomplete last window (it then adds nothing and
    leaves the batch statistics as they were).
    """
    # Scaling the loss, not the gradients, saves a pass over them.
    grads, value, weight, new_stats = forward(params, batch, stats, index, scale)
    grads = jax.tree.map(lambda g: g.astype(dtype), grads)
    new_stats = jax.tree.map(lambda n, o: jnp.where(scale > 0, n, o), new_stats, stats)
    return grads, value.astype(dtype), weight.astype(dtype) * scale.astype(dtype), new_stats


def select(flag: jax.Array, on_true: Any, on_false: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(flag, a, b), on_true, on_false)


def fused_update(
    forward: Forward,
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    batch_stats: Any,
    micro_batches: Any,
    micro_weights: jax.Array,
    *,
    axis_name: str,
    dtype: Any,
    to_varying: Callable[[Any], Any],
    skip_nonfinite: bool,
) -> Update:
    """One optimizer step over ``[accum_steps, micro_batch_size, ...]`` local data.

    ``micro_weights`` (``[accum_steps]``, the same on every device) scales each
    micro-batch's gradient, loss and weight; 0 marks padding.

    ``to_varying`` marks params as per-device before the loop. Without it
    (shard_map with check_vma) JAX treats replicated params as invariant and
    the transpose of their implicit broadcast is a psum: an all-reduce inside
    the scan body, i.e. one per micro-batch.
    """
    local_params = to_varying(params)

    def micro_step(carry, inputs):
        sums, stats = carry
        batch, scale, index = inputs
        *parts, stats = _scaled(forward, local_params, batch, stats, index, scale, dtype)
        return (jax.tree.map(jnp.add, sums, tuple(parts)), stats), None

    # Also for one micro-batch: without the loop XLA kept 19% more temporaries
    # on the digits CNN, for no time measured (docs/decisions.md).
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), params)
    init = to_varying(((zeros, jnp.zeros([], dtype), jnp.zeros([], dtype)), batch_stats))
    indices = jnp.arange(len(micro_weights))
    ((grad_sum, loss_sum, weight), stats), _ = jax.lax.scan(
        micro_step, init, (micro_batches, micro_weights, indices)
    )
    wire = device0(stats, axis_name, dtype)
    grad_sum, loss, weight, wire = all_reduce_sums(grad_sum, loss_sum, weight, wire, axis_name)
    grad_norm = optax.tree.norm(grad_sum) / weight
    finite = all_finite(grad_norm, loss, wire)
    ok = finite if skip_nonfinite else jnp.ones([], bool)

    def apply(operands):
        params, opt_state = operands
        # Divided here, the mean fuses into the optimizer's pass over the gradients.
        grads = mean_grads(grad_sum, weight, like=params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    if skip_nonfinite:
        # A branch, not a select over params and optimizer state: a skipped step
        # costs nothing and an applied one no extra pass (measured 1.3 ms of a
        # 6.6 ms MLP step with selects, docs/decisions.md).
        out = jax.eval_shape(apply, (params, opt_state))

        def keep(operands):  # as they were, in the dtypes the update gives
            return jax.tree.map(lambda o, x: x.astype(o.dtype), out, operands)

        new_params, new_opt_state = jax.lax.cond(ok, apply, keep, (params, opt_state))
    else:
        new_params, new_opt_state = apply((params, opt_state))
    metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite}
    return Update(
        new_params,
        new_opt_state,
        select(ok, from_wire(wire, batch_stats), batch_stats),
        ok,
        ~ok,
        metrics,
    )


def multisteps_update(
    forward: Forward,
    optimizer: optax.MultiSteps,
    params: Any,
    opt_state: optax.MultiStepsState,
    accum: AccumState,
    batch_stats: Any,
    batch: Any,
    micro_weight: jax.Array,
    *,
    axis_name: str,
    accum_steps: int,
    dtype: Any,
    to_varying: Callable[[Any], Any],
    skip_nonfinite: bool,
) -> tuple[Update, AccumState]:
    """One micro-batch through ``optax.MultiSteps``; syncs only when emitting.

    ``optimizer`` wraps ``sync_on_emit(inner=user_optimizer)`` with
    ``use_grad_mean=False``. ``emit`` comes from the replicated mini-step
    counter, so every device takes the same branch of the guarded all-reduce.
    ``micro_weight`` scales this micro-batch (0: padding of a last window).
    A skipped (non-finite) update leaves params, the inner optimizer state and
    the batch statistics as they were; MultiSteps has already reset the window.
    """
    mini_step = opt_state.mini_step
    start = select(mini_step == 0, to_varying(batch_stats), accum.batch_stats)
    grads, value, weight, stats = _scaled(
        forward, to_varying(params), batch, start, mini_step, micro_weight, dtype
    )
    loss_sum, weight = accum.loss_sum + value, accum.weight + weight
    emit = mini_step == accum_steps - 1
    updates, new_opt_state = optimizer.update(
        grads,
        opt_state,
        params,
        emit=emit,
        loss_sum=loss_sum,
        weight=weight,
        extra=device0(stats, axis_name, dtype),
    )
    # MultiSteps resets its accumulators as (1 - emit) * acc, which keeps a NaN.
    new_opt_state = new_opt_state._replace(
        acc_grads=jax.tree.map(
            lambda a: jnp.where(emit, jnp.zeros_like(a), a), new_opt_state.acc_grads
        )
    )
    sync = find_state(new_opt_state.inner_opt_state, SyncState)
    ok = sync.finite if skip_nonfinite else jnp.ones([], bool)
    applied, skipped = emit & ok, emit & ~ok
    kept = new_opt_state._replace(
        inner_opt_state=opt_state.inner_opt_state, gradient_step=opt_state.gradient_step
    )
    new_params = optax.apply_updates(params, updates)
    update = Update(
        select(skipped, params, new_params),
        select(skipped, kept, new_opt_state),
        select(applied, from_wire(sync.extra, batch_stats), batch_stats),
        applied,
        skipped,
        {"loss": sync.loss, "grad_norm": sync.grad_norm, "finite": sync.finite, "emitted": emit},
    )
    accum = AccumState(*(jnp.where(emit, jnp.zeros_like(x), x) for x in (loss_sum, weight)))
    return update, accum._replace(
        batch_stats=select(emit, jax.tree.map(jnp.zeros_like, stats), stats)
    )


def find_state(opt_state: Any, kind: type) -> Any:
    """The first node of type ``kind`` in an optimizer state, or None."""
    nodes = jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, kind))
    return next((node for node in nodes if isinstance(node, kind)), None)


def learning_rate(opt_state: Any) -> jax.Array | None:
    """The learning rate held by ``optax.inject_hyperparams`` state, if any."""
    nodes = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(getattr(x, "hyperparams", None), dict)
    )
    for node in nodes:
        hyperparams = getattr(node, "hyperparams", None)
        if isinstance(hyperparams, dict) and "learning_rate" in hyperparams:
            return hyperparams["learning_rate"]
    return None

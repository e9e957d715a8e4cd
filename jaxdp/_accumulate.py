"""Per-device step bodies: fused accumulation and the multisteps (streaming) path.

Both run inside ``shard_map`` (or ``pmap``) on ONE device's data and state and
communicate only through one psum per optimizer step
(:func:`jaxdp._sync.all_reduce_sums`). They accumulate per-device SUMS of
micro-batch gradients, losses and weights, and divide by the global weight
after the all-reduce. Device 0's batch statistics ride in the same psum, and
the finiteness of its result decides, identically on every device, whether
the update is applied or skipped (:class:`StepEnd`, shared by both paths).
"""

from __future__ import annotations

import functools
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
    end: StepEnd,
    to_varying: Callable[[Any], Any],
    micro_sync: Callable[[Any], Any] | None = None,
) -> Update:
    """One optimizer step over ``[accum_steps, micro_batch_size, ...]`` local data.

    ``micro_weights`` (``[accum_steps]``, the same on every device) scales each
    micro-batch's gradient, loss and weight; 0 marks padding.

    ``to_varying`` marks params as per-device before the loop. Without it
    (shard_map with check_vma) JAX treats replicated params as invariant and
    the transpose of their implicit broadcast is a psum: an all-reduce inside
    the scan body, i.e. one per micro-batch.

    ``micro_sync`` (ZeRO stage 2) reduce-scatters each micro-batch's gradients
    into this device's shard of the sums; ``end`` is the step's end
    (:class:`StepEnd`, or :class:`jaxdp._zero_step.ShardedEnd`).
    """
    local_params = to_varying(params)
    dtype, micro_sync = end.dtype, micro_sync or _identity

    def micro_step(carry, inputs):
        sums, stats = carry
        batch, scale, index = inputs
        grads, *parts, stats = _scaled(forward, local_params, batch, stats, index, scale, dtype)
        parts = (micro_sync(grads), *parts)
        return (jax.tree.map(jnp.add, sums, tuple(parts)), stats), None

    # Also for one micro-batch: without the loop XLA kept 19% more temporaries
    # on the digits CNN, for no time measured (docs/decisions.md).
    like = jax.eval_shape(micro_sync, jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), params))
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), like)
    init = to_varying(((zeros, jnp.zeros([], dtype), jnp.zeros([], dtype)), batch_stats))
    indices = jnp.arange(len(micro_weights))
    (sums, stats), _ = jax.lax.scan(micro_step, init, (micro_batches, micro_weights, indices))
    return end(optimizer, params, opt_state, batch_stats, *sums, stats)[0]


def _identity(x: Any) -> Any:
    return x


class StepEnd(NamedTuple):
    """The end of an optimizer step, the same on both paths: the one all-reduce, the
    finiteness check, and the user's optimizer or the skip."""

    axis_name: str
    dtype: Any  # of the accumulators, and of the loss and norm the SyncState keeps
    skip_nonfinite: bool
    comm_dtype: Any = None  # the gradients' dtype on the wire (bfloat16), None: their own
    num_devices: int = 1

    def __call__(
        self,
        optimizer: optax.GradientTransformation,
        params: Any,
        opt_state: Any,
        batch_stats: Any,
        grad_sum: Any,
        loss_sum: jax.Array,
        weight: jax.Array,
        stats: Any,
    ) -> tuple[Update, SyncState]:
        """All-reduces this device's sums with device 0's ``stats``, then updates or
        skips. Returns the update and what was synchronized (``SyncState``)."""
        wire = device0(stats, self.axis_name, self.dtype)
        grad_sum, loss, weight, wire = all_reduce_sums(
            grad_sum, loss_sum, weight, wire, self.axis_name, self.comm_dtype, self.num_devices
        )
        grad_norm = optax.tree.norm(grad_sum) / weight
        finite = all_finite(grad_norm, loss, wire)
        ok = finite if self.skip_nonfinite else jnp.ones([], bool)

        def apply(operands):
            params, opt_state = operands
            # Divided here, the mean fuses into the optimizer's pass over the gradients.
            grads = mean_grads(grad_sum, weight, like=params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        if self.skip_nonfinite:
            # A branch, not a select over params and optimizer state: a skipped step
            # costs nothing and an applied one no extra pass (measured 1.3 ms of a
            # 6.6 ms MLP step with selects, docs/decisions.md).
            keep = functools.partial(cast_like, self.updated_like(optimizer, params, opt_state))
            new_params, new_opt_state = jax.lax.cond(ok, apply, keep, (params, opt_state))
        else:
            new_params, new_opt_state = apply((params, opt_state))
        new_stats = select(ok, from_wire(wire, batch_stats), batch_stats)
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite}
        sync = SyncState(loss.astype(self.dtype), grad_norm.astype(self.dtype), finite, wire)
        return Update(new_params, new_opt_state, new_stats, ok, ~ok, metrics), sync

    def updated_like(self, optimizer: Any, params: Any, opt_state: Any) -> Any:
        return updated_like(optimizer, params, opt_state)


def updated_like(optimizer: optax.GradientTransformation, params: Any, opt_state: Any) -> Any:
    """Shapes and dtypes of ``(params, opt_state)`` after an update (the gradients
    reach the optimizer in the parameters' dtypes)."""

    def apply(params, opt_state):
        updates, opt_state = optimizer.update(params, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.eval_shape(apply, params, opt_state)


def cast_like(like: Any, tree: Any) -> Any:
    """``tree`` in the dtypes of ``like``: what a branch that keeps its operands
    returns, so that both branches of a ``lax.cond`` agree."""
    return jax.tree.map(lambda o, x: x.astype(o.dtype), like, tree)


def multisteps_update(
    forward: Forward,
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: optax.MultiStepsState,
    accum: AccumState,
    batch_stats: Any,
    batch: Any,
    micro_weight: jax.Array,
    *,
    end: StepEnd,
    accum_steps: int,
    to_varying: Callable[[Any], Any],
    micro_sync: Callable[[Any], Any] | None = None,
) -> tuple[Update, AccumState]:
    """One micro-batch of a window of ``accum_steps`` calls; syncs only when emitting.

    ``opt_state`` is :func:`multisteps_init`'s: ``optax.MultiSteps``' layout
    around ``(SyncState, optimizer's state)``. Every call adds its micro-batch's
    gradient, loss and weight to this device's sums (``micro_weight`` scales
    them: 0 for the padding of a last window). Then one ``lax.cond`` on the
    replicated mini-step counter: a call inside the window leaves everything
    else as it was; the window's last call runs the all-reduce and the user's
    ``optimizer`` (or the non-finite skip) as the fused path does, and resets
    the sums. A skipped update keeps the last applied one's ``SyncState``.
    """
    mini_step, dtype = opt_state.mini_step, end.dtype
    emits = mini_step == accum_steps - 1
    start = select(mini_step == 0, to_varying(batch_stats), accum.batch_stats)
    grads, value, weight, stats = _scaled(
        forward, to_varying(params), batch, start, mini_step, micro_weight, dtype
    )
    grads = (micro_sync or _identity)(grads)
    # In place in the donated state, the one pass over the gradients of a call that
    # does not emit; in the sums' own shape (shard_map: this device's [1, ...]
    # block), as XLA:CPU adds in place only into a buffer of the same shape.
    acc = jax.tree.map(lambda a, g: a + g.reshape(a.shape), opt_state.acc_grads, grads)
    sums = jax.tree.map(lambda a, g: a.reshape(g.shape), acc, grads)
    window = (sums, accum.loss_sum + value, accum.weight + weight, stats)

    def emit(operands):
        params, (sync, inner_state), batch_stats, window = operands
        update, new_sync = end(optimizer, params, inner_state, batch_stats, *window)
        sync = select(update.applied, new_sync, sync)
        return update._replace(opt_state=(sync, update.opt_state))

    def keep(operands):
        params, (sync, inner_state), batch_stats, _ = operands
        like = end.updated_like(optimizer, params, inner_state)
        params, inner_state = cast_like(like, (params, inner_state))
        no = jnp.zeros([], bool)
        metrics = {"loss": sync.loss, "grad_norm": sync.grad_norm, "finite": sync.finite}
        return Update(params, (sync, inner_state), batch_stats, no, no, metrics)

    operands = (params, opt_state.inner_opt_state, batch_stats, window)
    if accum_steps == 1:
        # Every call emits: this call's gradient is the window's sums, and the state's
        # stay the zeros they start as (no pass over them: the fused step's speed).
        update = emit((*operands[:3], (grads, *window[1:])))
        acc = opt_state.acc_grads
    else:
        update = jax.lax.cond(emits, emit, keep, operands)
        acc = jax.lax.cond(emits, _reset, _unchanged, (acc, update.metrics["grad_norm"]))
    small = jax.tree.map(lambda x: jnp.where(emits, jnp.zeros_like(x), x), window[1:])
    new_opt_state = opt_state._replace(
        mini_step=(mini_step + 1) % accum_steps,
        gradient_step=opt_state.gradient_step + update.applied.astype(jnp.int32),
        inner_opt_state=update.opt_state,
        acc_grads=acc,
    )
    update = update._replace(opt_state=new_opt_state, metrics={**update.metrics, "emitted": emits})
    return update, AccumState(*small)


# The window's sums restart at zero after the emitting call, in a branch of their
# own that reads them after the update's branch (the norm passed from it is the
# data dependency that orders the two). Only so did XLA:CPU write them in place:
# zeros as a fresh constant, or the reset inside the update's branch, made it copy
# the sums on every call, a pass over the gradients (tests/core/test_streaming_program.py).
def _reset(operands: tuple[Any, jax.Array]) -> Any:
    acc, after = operands
    # +0 for any value of `after` and every element, NaN and Inf included: a value
    # XLA cannot fold into a constant, computed from the sums so it is written over them.
    ordered = jnp.isfinite(after)

    def zero(a):
        return jnp.where(ordered & jnp.isfinite(a), jnp.abs(a) * 0, 0).astype(a.dtype)

    return jax.tree.map(zero, acc)


def _unchanged(operands: tuple[Any, jax.Array]) -> Any:
    return operands[0]


def multisteps_init(
    optimizer: optax.GradientTransformation,
    params: Any,
    *,
    dtype: Any,
    extra_like: Any,
    sums_like: Any = None,
) -> optax.MultiStepsState:
    """The multisteps path's optimizer state: ``optax.MultiSteps``' layout, as
    ``optax.MultiSteps(chain(sync, optimizer), use_grad_mean=False)`` builds it
    (so ``optax.MultiSteps.has_updated`` reads it): the mini-step and update
    counters, ``(SyncState, optimizer's state)`` and the gradient sums in ``dtype``
    (one copy here; the step keeps one per device), shaped like ``sums_like``
    (default ``params``; ZeRO stage 2: a device's shard)."""
    sums_like = params if sums_like is None else sums_like
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), extra_like)
    sync = SyncState(jnp.zeros([], dtype), jnp.zeros([], dtype), jnp.ones([], bool), zeros)
    return optax.MultiStepsState(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=jnp.zeros([], jnp.int32),
        inner_opt_state=(sync, optimizer.init(params)),
        acc_grads=jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), sums_like),
        skip_state=(),
    )


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

"""Stage 1 of a step, on one device: every micro-batch's gradient, loss and weight added
into the window's sums (in the accumulator dtype), its batch statistics carried on.

Runs inside the mesh map (``shard_map`` or ``pmap``) on this device's rows. It sends
nothing, but at ZeRO stage 2, where each micro-batch's gradients are reduce-scattered
before they are added (``scatter``), so the sums kept are this device's block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Forward = Callable[..., tuple[Any, jax.Array, jax.Array, Any, Any]]
"""``forward(trainable, micro_batch, batch_stats, micro_index, scale) -> (grads, value,
weight, new_batch_stats, aux)`` of one micro-batch on one device, the loss times ``scale``
(:func:`jaxdp._forward.micro_forward`)."""


class Sums(NamedTuple):
    """One device's sums over the micro-batches of a window so far."""

    grads: Any
    loss_sum: jax.Array
    weight: jax.Array
    batch_stats: Any  # this device's, after its last micro-batch
    aux: Any = None  # loss_fn's aux (has_aux) summed as the loss is: times the scale


def add_micro_batch(
    forward: Forward,
    trainable: Any,
    sums: Sums,
    batch: Any,
    scale: jax.Array,
    index: jax.Array,
    *,
    scatter: Callable[[Any], Any],
    add: Callable[[Any, Any], Any],
) -> Sums:
    """``sums`` plus one micro-batch.

    ``scale`` is its weight in the window: 1, or 0 for a padding micro-batch that
    fills an incomplete last window (it then adds nothing and leaves the batch
    statistics as they were). The loss is scaled, not the gradients: a pass less.
    """
    grads, value, weight, stats, aux = forward(trainable, batch, sums.batch_stats, index, scale)
    dtype = sums.loss_sum.dtype
    grads = scatter(jax.tree.map(lambda g: g.astype(dtype), grads))
    # In the carried dtype: a Linen BatchNorm writes its forward's (flax's bridge modules).
    stats = jax.tree.map(
        lambda n, o: jnp.where(scale > 0, n.astype(o.dtype), o), stats, sums.batch_stats
    )
    weight = weight.astype(dtype) * scale.astype(dtype)
    aux = jax.tree.map(lambda s, a: s + jnp.asarray(a, dtype) * scale.astype(dtype), sums.aux, aux)
    loss_sum = sums.loss_sum + value.astype(dtype)
    return Sums(add(sums.grads, grads), loss_sum, sums.weight + weight, stats, aux)


def zero_sums(like: Any, batch_stats: Any, dtype: Any, aux: Any = None) -> Sums:
    """Empty sums shaped like ``like`` (the gradients as ``scatter`` leaves them) and
    ``aux`` (shapes)."""
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, dtype), (like, aux))
    return Sums(zeros[0], jnp.zeros([], dtype), jnp.zeros([], dtype), batch_stats, zeros[1])


def accumulate(
    forward: Forward,
    trainable: Any,
    batch_stats: Any,
    micro_batches: Any,
    micro_weights: jax.Array,
    *,
    dtype: Any,
    scatter: Callable[[Any], Any],
    to_varying: Callable[[Any], Any],
    with_aux: bool = False,
) -> Sums:
    """A whole window in one call (the ``fused`` path): a ``lax.scan`` over this
    device's ``[accum_steps, micro_batch_size, ...]`` rows.

    ``to_varying`` marks the replicated parameters per-device before the loop.
    Without it (``shard_map`` with ``check_vma``) JAX treats them as invariant and
    the transpose of their implicit broadcast is a psum: an all-reduce inside the
    loop, one per micro-batch. ``with_aux``: ``forward`` returns an aux to sum.
    """
    local = to_varying(trainable)
    like = jax.eval_shape(scatter, jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), trainable))
    aux = None
    if with_aux:  # its shapes, from a trace of the first micro-batch's forward
        first = jax.tree.map(lambda x: x[0], micro_batches)
        aux = jax.eval_shape(forward, local, first, batch_stats, 0, micro_weights[0])[-1]
    init = to_varying(zero_sums(like, batch_stats, dtype, aux))

    def body(sums, inputs):
        batch, scale, index = inputs
        return add_micro_batch(
            forward, local, sums, batch, scale, index, scatter=scatter, add=_plus
        ), None

    # Also for one micro-batch: without the loop XLA kept 19% more temporaries on
    # the digits CNN, for no time measured (docs/decisions.md).
    indices = jnp.arange(len(micro_weights))
    return jax.lax.scan(body, init, (micro_batches, micro_weights, indices))[0]


def _plus(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)

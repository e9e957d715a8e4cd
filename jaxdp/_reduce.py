"""Stage 2 of a step, on one device: the window's sums of every device made global, in
the step's only gradient collective.

Replicated (stage 0): ONE psum of the gradient sums, the loss and weight sums (and
``loss_fn``'s aux sums) and device 0's batch statistics. Split (ZeRO stages 1 and
2): ONE reduce-scatter of the split leaves' sums (at stage 2 already done per
micro-batch, in stage 1), then one small psum of the leaves kept whole, the loss,
weight and aux sums, device 0's batch statistics and the split blocks' sum of
squares (for the global gradient norm).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ._accumulate import Sums
from ._model_state import device0
from ._shards import ShardPlan, compress, decompress


class Reduced(NamedTuple):
    """The window's global sums (on the logical arrays after the map: the whole leaves
    replicated, the split ones each device's block)."""

    grads: Any
    loss_sum: jax.Array
    weight: jax.Array
    batch_stats: Any  # device 0's, on the wire (:func:`jaxdp._model_state.wire_dtype`)
    squares: jax.Array  # the squared global norm of ``grads``
    aux: Any = None  # loss_fn's aux summed (has_aux)


def reduce(
    plan: ShardPlan,
    sums: Sums,
    *,
    scattered: bool,
    wire: Any = None,
) -> Reduced:
    """The global sums of every device's ``sums``. ``scattered``: the split leaves are
    already this device's block of the global sum (ZeRO stage 2). ``wire`` (bfloat16)
    sends the gradients narrow, as torch's ``bf16_compress_hook`` does."""
    axis, n, dtype = plan.axis_name, plan.num_devices, sums.loss_sum.dtype
    grads = sums.grads if scattered else plan.reduce_scatter(sums.grads, wire)
    whole = plan.whole(grads)
    dtypes = [x.dtype for x in whole]
    payload = [[compress(x, wire, n) for x in whole], sums.loss_sum, sums.weight]
    payload += [device0(sums.batch_stats, axis, dtype), sums.aux]
    if plan.split:
        payload.append(_squares(plan.blocks(grads), dtype))
    summed = jax.lax.psum(tuple(payload), axis)
    whole = [decompress(x, d, wire, n) for x, d in zip(summed[0], dtypes, strict=True)]
    squares = _squares(whole, dtype)
    if plan.split:
        squares = summed[5] + squares
    grads = plan.with_whole(grads, whole)
    return Reduced(grads, summed[1], summed[2], summed[3], squares, summed[4])


def _squares(leaves: list[Any], dtype: Any) -> jax.Array:
    """The sum of squares of ``leaves``, as ``optax.tree.norm`` adds them."""
    return sum((jnp.sum(jnp.square(x)) for x in leaves), jnp.zeros([], dtype))

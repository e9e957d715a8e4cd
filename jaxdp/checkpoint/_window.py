"""An open window's gradient sums read into another layout of the same batch identity.

Mid-window (``multisteps``) a gradient sum is held in one of three layouts, by
ZeRO stage and mesh: each device's own sums (``[num_devices, *shape]``: stages 0
and 1, and a leaf kept whole at stages 2 and 3), the global sum (``shape``, split
over the mesh: a split leaf at stages 2 and 3) or each replica group's sum
(``[replicas, *shape]``: a split leaf under HSDP). Every one adds up to the same
total over its leading axis (the window's end sums the rows: an all-reduce, a
reduce-scatter per call, or the replicas' all-reduce), so a window saved in one
layout continues in another as that total: the global sum itself, or in the first
row with zeros in the others. The result equals the saved layout's to rounding
(the rows are added in another order), not bitwise. The other sums (loss, weights,
batch statistics, aux) are per device in every layout, and a window of another
batch identity is refused before (:func:`._rules.check_compatible`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_GRADS = "window/grads/"


def relaid(name: str, leaves: dict[str, Any], shape: Any) -> bool:
    """Whether leaf ``name``, saved as ``leaves`` (the meta's) describes it, is a window
    gradient sum in another layout than ``shape`` (this run's) that re-lays out: both
    its parameter's shape, with at most one leading axis of rows."""
    saved, own_shape = leaves.get(name), param_shape(name, leaves)
    if saved is None or own_shape is None or list(saved["shape"]) == list(shape):
        return False
    return all(
        len(s) - len(own_shape) in (0, 1) and list(s[len(s) - len(own_shape) :]) == own_shape
        for s in (list(saved["shape"]), list(shape))
    )


def param_shape(name: str, leaves: dict[str, Any]) -> list[int] | None:
    """The shape of the parameter whose window gradient sum is leaf ``name`` (None: not one)."""
    if not name.startswith(_GRADS):
        return None
    own = leaves.get("params/" + name[len(_GRADS) :])
    return None if own is None else list(own["shape"])


def read_as(shape: Any, like: Any, *, whole: bool = False) -> jax.ShapeDtypeStruct:
    """How a sum saved as ``shape`` is read for ``like`` (this run's leaf): split as
    ``like`` is, behind its rows, when only the saved one has rows; else whole (also
    with ``whole``: ZeRO stage 3's padded leaves, read in the model's shapes, which the
    devices need not divide)."""
    spec = P()
    if not whole and len(shape) == len(like.shape) + 1:
        spec = P(None, *like.sharding.spec)
    return jax.ShapeDtypeStruct(
        tuple(shape), like.dtype, sharding=NamedSharding(like.sharding.mesh, spec)
    )


def relay(x: jax.Array, like: Any, rank: int) -> jax.Array:
    """``x`` (a saved sum of a parameter of ``rank`` dimensions) in ``like``'s layout:
    its total over its rows, as the global sum or in the first row (padded with zeros to
    ``like``'s shape where ZeRO stage 3 holds it padded)."""

    def laid_out(x: jax.Array) -> jax.Array:
        total = x.sum(0) if x.ndim > rank else x
        own = like.shape[len(like.shape) - rank :]
        total = jnp.pad(total, [(0, n - m) for m, n in zip(total.shape, own, strict=True)])
        if len(like.shape) == rank:
            return total
        return jnp.zeros(like.shape, like.dtype).at[0].set(total)

    return jax.jit(laid_out, out_shardings=like.sharding)(x)

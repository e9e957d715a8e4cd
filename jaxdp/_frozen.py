"""Frozen and unused parameters.

Frozen leaves are replaced by ``optax.MaskedNode()`` (a pytree node without
leaves, what ``optax.masked`` uses) in the tree the step differentiates,
all-reduces and hands to the optimizer: they get no gradient, travel in no
all-reduce, have no optimizer state and take no update or weight decay. The
tree keeps its structure, so optimizer masks written for the full parameter
tree (``optax.adamw(mask=...)``) still apply.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Trainable = Any
"""Which parameters train: None (all), a pytree of bools, a predicate ``(path, value) ->
bool`` or an NNX filter (:func:`trainable_mask`)."""


def _named(path: tuple) -> tuple[str, ...]:
    names = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)))
                break
        else:
            names.append(str(key))
    return tuple(names)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def trainable_mask(params: Any, trainable: Trainable) -> tuple[bool, ...]:
    """One bool per array leaf of ``params`` (in ``jax.tree.leaves`` order).

    ``trainable`` is None (all), a pytree of bools with the structure of
    ``params`` (NNX: of its ``nnx.State`` of ``Param`` variables), or a
    predicate ``(path, value) -> bool`` where ``path`` is a tuple of names
    (``("embed", "embedding")``) and ``value`` the array or, for an NNX
    module, the ``nnx.Variable``; any NNX filter works for NNX modules.
    """
    count = len(jax.tree.leaves(params))
    if trainable is None:
        return (True,) * count
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]
    if callable(trainable) or isinstance(trainable, (str, type)):
        predicate = trainable if callable(trainable) else nnx.filterlib.to_predicate(trainable)
        mask = tuple(bool(predicate(_named(path), leaf)) for path, leaf in leaves)
    else:
        flags = jax.tree.leaves(trainable)
        if len(flags) != count:
            raise ValueError(
                f"trainable has {len(flags)} leaves but the model has {count} parameter arrays; "
                "give one bool per parameter (or a predicate on (path, value))"
            )
        mask = tuple(bool(f) for f in flags)
    if len(mask) != count:  # a Variable holding several arrays
        raise ValueError("trainable: every parameter variable must hold one array")
    return mask


def split_trainable(params: Any, mask: tuple[bool, ...]) -> Any:
    """``params`` with every frozen leaf replaced by ``optax.MaskedNode()``."""
    leaves, treedef = jax.tree.flatten(params)
    if all(mask):
        return params
    return treedef.unflatten(
        [x if keep else optax.MaskedNode() for x, keep in zip(leaves, mask, strict=True)]
    )


def combine(trainable: Any, params: Any, mask: tuple[bool, ...]) -> Any:
    """The full parameter tree: trainable leaves from ``trainable``, frozen from ``params``."""
    if all(mask):
        return trainable
    leaves, treedef = jax.tree.flatten(params)
    it = iter(jax.tree.leaves(trainable))
    return treedef.unflatten(
        [next(it) if keep else x for x, keep in zip(leaves, mask, strict=True)]
    )


def skip_unused(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
    """Leaves whose (all-reduced) gradient is exactly zero take no step, like torch's
    optimizers skip parameters whose ``.grad`` is None.

    For such a leaf the update is zero and every optimizer-state subtree laid
    out like the gradients (momentum, Adam's moments) keeps its old value;
    state shared by all leaves (Adam's step count, schedules) still advances,
    where torch keeps a step count per parameter. A used parameter whose
    gradient happens to be exactly zero everywhere is skipped too.
    """
    inner = optax.with_extra_args_support(inner)

    def update(updates, state, params=None, **extra):
        used = jax.tree.map(lambda g: jnp.any(g != 0), updates)
        new_updates, new_state = inner.update(updates, state, params, **extra)
        new_updates = jax.tree.map(
            lambda u, k: jnp.where(k, u, jnp.zeros_like(u)), new_updates, used
        )
        return new_updates, _keep_unused(state, new_state, used)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def _keep_unused(old: Any, new: Any, used: Any) -> Any:
    structure = jax.tree.structure(used)

    def like_params(x: Any) -> bool:
        return jax.tree.structure(x) == structure

    def keep(o: Any, n: Any) -> Any:
        if like_params(o):
            return jax.tree.map(lambda a, b, k: jnp.where(k, b, a), o, n, used)
        return n

    return jax.tree.map(keep, old, new, is_leaf=like_params)

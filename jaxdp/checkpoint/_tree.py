"""A training state as orbax saves it: a tree of arrays in three items by where each leaf
lies (replicated, the window's per-device sums, leaves split over the mesh), and back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._train_state import SkipCounts, TrainState
from ._rules import is_accumulator, is_per_device, leaf_name, named

ITEMS = ("replicated", "per_device", "shards")


def saved_tree(state: TrainState) -> dict[str, Any]:
    """What is saved: the state without its static NNX graph, rng keys as their data, the
    skip counters under their own names (format 3, as before they were one record)."""
    return {
        "step": state.step,
        "params": state.params,
        "opt_state": state.opt_state,
        "window": state.window,
        "model_state": jax.tree.map(_key_data, state.model_state),
        "skipped_steps": state.skipped_steps,
        "consecutive_skips": state.consecutive_skips,
    }


def own_shapes(state: TrainState) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of each leaf of :func:`saved_tree` that the state holds padded
    (ZeRO stage 3, ``state.logical``), in the model's shape: the parameters and the
    optimizer state by the record, a window's gradient sum by its parameter's (its rows,
    then that shape). A checkpoint describes, compares and hashes the leaves in these
    shapes, so that a leaf padded for one device count reads into another's layout."""
    if state.logical is None:
        return {}
    out: dict[str, tuple[int, ...]] = {}
    for part, shapes in (("params", state.logical.params), ("opt_state", state.logical.opt_state)):
        for (name, _), shape in zip(named({part: getattr(state, part)}), shapes, strict=True):
            if shape is not None:
                out[name] = tuple(shape)
    if state.window is not None:
        for name, x in named({"window": {"grads": state.window.grads}}):
            own = out.get("params/" + name[len("window/grads/") :])
            if own is not None:
                out[name] = (*x.shape[: x.ndim - len(own)], *own)
    return out


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_data(x: Any) -> Any:
    """An ``nnx.Rngs`` key as its uint32 data: orbax stores plain arrays."""
    return jax.random.key_data(x) if _is_key(x) else x


def _like_key(x: Any, like: Any) -> Any:
    return jax.random.wrap_key_data(x, impl=jax.random.key_impl(like)) if _is_key(like) else x


def state_from_tree(tree: dict[str, Any], like: TrainState) -> TrainState:
    """The state of a saved tree read back, with ``like``'s NNX graph, rng key types and
    ``logical`` record (stage 3's padded leaves' shapes)."""
    return TrainState(
        step=tree["step"],
        params=tree["params"],
        opt_state=tree["opt_state"],
        window=tree["window"],
        graphdef=like.graphdef,
        model_state=jax.tree.map(_like_key, tree["model_state"], like.model_state),
        skips=SkipCounts(tree["skipped_steps"], tree["consecutive_skips"]),
        logical=like.logical,
    )


def kind(name: str, split: bool) -> str:
    """The item a leaf is saved in: ``per_device`` for the window's per-device sums (zero
    at a step boundary, not read there), ``shards`` for other leaves split over the mesh
    (ZeRO; every process writes its own blocks), ``replicated`` for the rest."""
    if not split:
        return "replicated"
    return "per_device" if is_accumulator(name) else "shards"


def own_kind(name: str, x: Any) -> str:
    """:func:`kind` of a leaf of this run's state."""
    return kind(name, is_per_device(x))


def split(tree: Any, kind_of: Callable[[str, Any], str] = own_kind) -> dict[str, Any]:
    """``{item: tree}`` for each of :data:`ITEMS`, the leaves of other items set to None."""

    def keep(which: str) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, x: x if kind_of(leaf_name(path), x) == which else None, tree
        )

    return {item: keep(item) for item in ITEMS}


def join(*trees: Any) -> Any:
    """The leaves of ``trees`` (as :func:`split` made them) in one tree."""

    def first(*leaves: Any) -> Any:
        return next((x for x in leaves if x is not None), None)

    return jax.tree.map(first, *trees, is_leaf=lambda x: x is None)


def abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def zeros(x: Any) -> jax.Array:
    return jax.jit(lambda: jnp.zeros(x.shape, x.dtype), out_shardings=x.sharding)()

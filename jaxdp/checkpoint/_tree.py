"""A training state as orbax saves it: a tree of arrays, split into replicated and per-device
leaves, and back."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._train_state import TrainState
from ._rules import is_per_device, is_shard, leaf_name


def saved_tree(state: TrainState) -> dict[str, Any]:
    """What is saved: the state without its static NNX graph, rng keys as their data."""
    return {
        "step": state.step,
        "params": state.params,
        "opt_state": state.opt_state,
        "accum": state.accum,
        "model_state": jax.tree.map(_key_data, state.model_state),
        "skipped_steps": state.skipped_steps,
        "consecutive_skips": state.consecutive_skips,
    }


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_data(x: Any) -> Any:
    """An ``nnx.Rngs`` key as its uint32 data: orbax stores plain arrays."""
    return jax.random.key_data(x) if _is_key(x) else x


def _like_key(x: Any, like: Any) -> Any:
    return jax.random.wrap_key_data(x, impl=jax.random.key_impl(like)) if _is_key(like) else x


def state_from_tree(tree: dict[str, Any], like: TrainState) -> TrainState:
    """The state of a saved tree read back, with ``like``'s NNX graph and rng key types."""
    return TrainState(
        tree["step"],
        tree["params"],
        tree["opt_state"],
        tree["accum"],
        like.graphdef,
        jax.tree.map(_like_key, tree["model_state"], like.model_state),
        tree["skipped_steps"],
        tree["consecutive_skips"],
    )


def split(tree: Any) -> tuple[Any, Any, Any]:
    """``(replicated, per_device, shards)``: ``tree`` three times, the other kinds of leaf
    set to None. ``per_device``: the accumulators (one row per device, zero at a step
    boundary); ``shards``: the optimizer state split over the mesh at a ZeRO stage."""

    def kind(path: Any, x: Any) -> str:
        if not is_per_device(x):
            return "replicated"
        return "shards" if is_shard(leaf_name(path)) else "per_device"

    def keep(which: str) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, x: x if kind(path, x) == which else None, tree
        )

    return keep("replicated"), keep("per_device"), keep("shards")


def join(*trees: Any) -> Any:
    """The leaves of ``trees`` (as :func:`split` made them) in one tree."""

    def first(*leaves: Any) -> Any:
        return next((x for x in leaves if x is not None), None)

    return jax.tree.map(first, *trees, is_leaf=lambda x: x is None)


def relaid(x: jax.Array, like: Any) -> jax.Array:
    """A ZeRO shard leaf saved on another device count, laid out as ``like``: the leaf's
    elements lead its flat array and zeros pad it, so cutting or padding zeros keeps them."""
    flat = x.reshape(-1)[: like.size]
    flat = jnp.pad(flat, (0, like.size - flat.size))
    return jax.device_put(flat.reshape(like.shape), like.sharding)


def abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def zeros(x: Any) -> jax.Array:
    return jax.jit(lambda: jnp.zeros(x.shape, x.dtype), out_shardings=x.sharding)()


def as_saved(shards: Any, meta: dict[str, Any], same_devices: bool) -> Any:
    """What to read the ZeRO shards into: this run's layout on the same device count;
    else the saved shapes, replicated on this mesh, to be re-laid out (:func:`relaid`)."""
    if same_devices:
        return abstract(shards)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(
            tuple(meta["leaves"][leaf_name(path)]["shape"]),
            x.dtype,
            sharding=NamedSharding(x.sharding.mesh, P()),
        ),
        shards,
    )

"""A training state as orbax saves it: a tree of arrays, split into replicated and per-device
leaves, and back."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._train_state import TrainState
from ._rules import is_per_device


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


def split(tree: Any) -> tuple[Any, Any]:
    """``(replicated, per_device)``: ``tree`` twice, the other kind of leaf set to None."""
    replicated = jax.tree.map(lambda x: None if is_per_device(x) else x, tree)
    per_device = jax.tree.map(lambda x: x if is_per_device(x) else None, tree)
    return replicated, per_device


def join(replicated: Any, per_device: Any) -> Any:
    return jax.tree.map(
        lambda a, b: b if a is None else a, replicated, per_device, is_leaf=lambda x: x is None
    )


def abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def zeros(x: Any) -> jax.Array:
    return jax.jit(lambda: jnp.zeros(x.shape, x.dtype), out_shardings=x.sharding)()

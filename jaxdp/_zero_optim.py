"""The user's optimizer on parameter shards (ZeRO stages 1 and 2): global-norm clipping
made global, and a probe that refuses any transform a shard cannot run exactly.

An elementwise transform (SGD, momentum, Nesterov, weight decay, Adam, AdamW, a
learning-rate schedule) updates each element of a shard exactly as it would in
the whole leaf. A transform that reads the whole gradient does not: global-norm
clipping (``optax.clip_by_global_norm``, :func:`jaxdp.parity.clip_grad_norm_like_torch`)
is therefore rebuilt to take its norm from a scalar psum of the shards' sums of
squares; anything else that reads beyond its element (per-leaf norms, factored
moments, shape-based masks) is found by :func:`check_shardable` and refused by name.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._zero import ShardLayout

_CHAIN = "chain.<locals>.update_fn"
_EXTRA = "with_extra_args_support.<locals>.update"
_CLIPS = {
    "clip_by_global_norm.<locals>.update_fn": "optax",
    "clip_grad_norm_like_torch.<locals>.update": "torch",
}


def _closure(fn: Any) -> dict[str, Any]:
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells), strict=True))


def _qualname(tx: Any) -> str:
    return getattr(tx.update, "__qualname__", type(tx).__name__)


def components(tx: optax.GradientTransformation) -> list[optax.GradientTransformation]:
    """The transforms ``tx`` chains (``optax.chain``, nested), in order; ``[tx]`` if none."""
    name = _qualname(tx)
    if name == _EXTRA:
        return components(_closure(tx.update)["tx"])
    if name == _CHAIN:
        inits, updates = _closure(tx.init)["init_fns"], _closure(tx.update)["update_fns"]
        parts = [optax.GradientTransformation(i, u) for i, u in zip(inits, updates, strict=True)]
        return [c for p in parts for c in components(p)]
    return [tx]


def describe(tx: optax.GradientTransformation) -> str:
    """A transform's name as its factory spells it (``clip_by_block_rms``)."""
    return _qualname(tx).split(".<locals>")[0]


def on_shards(tx: optax.GradientTransformation, axis_name: str) -> optax.GradientTransformation:
    """``tx`` with every global-norm clip taking the norm over all devices' shards."""
    name = _qualname(tx)
    if name == _EXTRA:
        inner = _closure(tx.update)["tx"]
        new = on_shards(inner, axis_name)
        return tx if new is inner else new
    if name == _CHAIN:
        inits, updates = _closure(tx.init)["init_fns"], _closure(tx.update)["update_fns"]
        parts = [optax.GradientTransformation(i, u) for i, u in zip(inits, updates, strict=True)]
        new = [on_shards(p, axis_name) for p in parts]
        changed = any(n is not p for n, p in zip(new, parts, strict=True))
        return optax.chain(*new) if changed else tx
    if name in _CLIPS:
        return _global_clip(_closure(tx.update)["max_norm"], axis_name, _CLIPS[name])
    return tx


def _global_clip(max_norm: Any, axis_name: str, like: str) -> optax.GradientTransformation:
    """The clip of ``like`` (optax's ``max / norm`` or torch's ``max / (norm + 1e-6)``)
    with the norm of the whole gradient: a scalar psum of the shards' sums of squares."""

    def update(updates, state, params=None):
        del params
        squares = sum(jnp.sum(jnp.square(u)) for u in jax.tree.leaves(updates))
        norm = jnp.sqrt(jax.lax.psum(squares, axis_name))
        if like == "torch":
            coef = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
            return jax.tree.map(lambda g: g * coef.astype(g.dtype), updates), state
        keep = norm < max_norm
        return jax.tree.map(
            lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm), updates
        ), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _probe_tree(trainable: Any, seed: int) -> Any:
    """Random values in the trainable tree's structure, each dimension cut to 3 or less,
    in float64 where JAX has it (else float32): the transforms do not care, and the
    comparison is then sharp whatever the parameters' own dtype."""
    rng = np.random.default_rng(seed)
    dtype = np.float64 if jax.config.read("jax_enable_x64") else np.float32
    return jax.tree.map(
        lambda x: rng.normal(size=tuple(min(d, 3) for d in x.shape)).astype(dtype), trainable
    )


def _agrees(tx: Any, trainable: Any, num_devices: int, axis_name: str) -> bool:
    """Two updates of a small probe: on whole leaves (``tx``) and on shards under a
    ``vmap`` over ``num_devices`` (``on_shards(tx)``) move the parameters alike.

    Compared as movements, each leaf's relative to its largest element, so a small
    term (a weight decay of 1e-4 next to Adam's step) still shows."""
    params, grads = _probe_tree(trainable, 0), [_probe_tree(trainable, s) for s in (1, 2)]

    def run(opt, p, *gs):
        state, start = opt.init(p), p
        for g in gs:
            updates, state = opt.update(g, state, p)
            p = optax.apply_updates(p, updates)
        return jax.tree.map(jnp.subtract, p, start)

    whole = jax.jit(lambda *a: run(tx, *a))(params, *grads)
    layout = ShardLayout(params, num_devices)

    def rows(tree):
        return jax.tree.map(lambda x: x.reshape(num_devices, -1), layout.padded(tree))

    sharded = jax.jit(jax.vmap(lambda *a: run(on_shards(tx, axis_name), *a), axis_name=axis_name))(
        *(rows(t) for t in (params, *grads))
    )
    for full, shards, size in zip(
        jax.tree.leaves(whole), jax.tree.leaves(sharded), layout.sizes, strict=True
    ):
        full = np.asarray(full)
        joined = np.asarray(shards).reshape(-1)[:size].reshape(full.shape)
        # The probe's own rounding (the clip's norm summed in another order).
        tight = 1e-10 if full.dtype == np.float64 else 1e-5
        if np.max(np.abs(joined - full), initial=0) > tight * np.max(np.abs(full), initial=0):
            return False
    return True


def check_shardable(
    optimizer: optax.GradientTransformation,
    trainable: Any,
    num_devices: int,
    axis_name: str,
    stage: int,
) -> None:
    """Raises ``ValueError`` naming the first transform of ``optimizer`` whose update
    on parameter shards differs from its update on whole parameters."""
    floating = jax.tree.map(
        lambda x: x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32),
        trainable,
    )
    if num_devices == 1 or _agrees(optimizer, floating, num_devices, axis_name):
        return
    culprit = next(
        (c for c in components(optimizer) if not _agrees(c, floating, num_devices, axis_name)),
        optimizer,
    )
    raise ValueError(
        f"zero_stage={stage}: the optimizer's {describe(culprit)} transform cannot run on "
        f"parameter shards exactly (on {num_devices} devices its update of a shard differs from "
        "its update of the whole parameter: it reads other elements, a parameter's shape or a "
        "norm jaxdp does not make global); use zero_stage=0, or elementwise transforms (SGD, "
        "momentum, weight decay, Adam, AdamW, schedules) with optax.clip_by_global_norm"
    )

"""Checkpoints of jaxdp 0.2 (format 2) read into jaxdp 0.3's state.

Format 2 kept the multisteps window inside an ``optax.MultiStepsState`` (the
gradient sums in ``opt_state/acc_grads``, the window's position in ``mini_step``,
the last update's loss and norm in ``inner_opt_state/0``, the user's optimizer's
state in ``inner_opt_state/1``) and its loss, weight and batch statistics in
``accum``; at ZeRO stages each optimizer-state leaf was flat and zero-padded to a
multiple of the device count, and stage 2's sums were each device's flat shard.
Format 3 keeps the window in ``window`` and every leaf in its own shape. Reading
renames and reshapes, nothing else: the values are the ones saved (their SHA-256s
are checked before), so a run continues exactly.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._meta import check_sha256
from ._rules import CheckpointError, named

_RENAMES = (  # format 2 prefix -> format 3 prefix, the first that matches
    ("opt_state/inner_opt_state/1/", "opt_state/"),
    ("opt_state/inner_opt_state/0/loss", "window/last/loss"),
    ("opt_state/inner_opt_state/0/grad_norm", "window/last/grad_norm"),
    ("opt_state/inner_opt_state/0/finite", "window/last/finite"),
    ("opt_state/inner_opt_state/0/extra", None),  # a copy of the committed statistics
    ("opt_state/gradient_step", None),  # the updates applied: the state's step
    ("opt_state/mini_step", "window/position"),
    ("opt_state/acc_grads/", "window/grads/"),
    ("accum/", "window/"),
)


def renamed(name: str, multisteps: bool) -> str | None:
    """A format 2 leaf's format 3 name (None: not kept)."""
    if not multisteps:
        return name
    for old, new in _RENAMES:
        if name.startswith(old):
            return None if new is None else new + name[len(old) :]
    return name


def upgraded_meta(meta: dict[str, Any], here: dict[str, Any]) -> dict[str, Any]:
    """``meta``'s leaves under their format 3 names and shapes: a leaf split over the
    mesh (flat and padded at ZeRO stages) takes the shape of this run's leaf it fills
    (``here``), so the rules compare what the state will hold."""
    multisteps = any(n.startswith("accum/") for n in meta["leaves"])
    leaves = {}
    for name, d in meta["leaves"].items():
        new = renamed(name, multisteps)
        if new is None:
            continue
        target = here.get(new)
        if target is not None and d["per_device"] and d["shape"] != target["shape"]:
            d = {**d, "shape": target["shape"]}  # laid out for the device count: re-laid
        leaves[new] = d
    return {**meta, "leaves": leaves, "format2_leaves": meta["leaves"]}


def read(
    manager: Any, number: int, meta: dict[str, Any], like_tree: Any, path: pathlib.Path
) -> Any:
    """The arrays of format 2 checkpoint ``number`` (``meta`` as :func:`upgraded_meta`
    made it) as a format 3 tree shaped like ``like_tree`` (the saved tree of this
    run's state), each leaf checked against its SHA-256 and placed like this run's."""
    like = dict(named(like_tree))
    mesh = next(x.sharding.mesh for x in like.values() if isinstance(x.sharding, NamedSharding))
    step_dir = pathlib.Path(manager.directory) / str(number)
    items = {}
    for item in ("replicated", "per_device", "shards"):
        if (step_dir / item).is_dir():
            tree = ocp.PyTreeCheckpointer().metadata(step_dir / item).item_metadata.tree
            target = jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=NamedSharding(mesh, P())),
                tree,
            )
            items[item] = ocp.args.StandardRestore(target)
    out = manager.restore(number, args=ocp.args.Composite(**items))
    saved = meta["format2_leaves"]  # as :func:`upgraded_meta` kept them
    multisteps = any(n.startswith("accum/") for n in saved)
    found: dict[str, Any] = {}
    for item in items:
        # Read without the state's classes, an NNX variable is a dict of its value.
        tree = {name.removesuffix("/value"): x for name, x in named(out[item])}
        check_sha256(tree, saved, lambda name: True)
        for name, x in tree.items():
            new = renamed(name, multisteps)
            if new is not None:
                found[new] = x
    missing = sorted(set(like) - set(found))
    if missing:
        raise CheckpointError(f"format 2 checkpoint {path} has no {', '.join(missing)}")
    placed = {name: _placed(name, found[name], x, like) for name, x in like.items()}
    treedef = jax.tree.structure(like_tree)
    return treedef.unflatten([placed[name] for name, _ in named(like_tree)])


def _placed(name: str, saved: jax.Array, like: Any, run: dict[str, Any]) -> jax.Array:
    """A saved leaf in the shape and sharding of this run's leaf ``like``: as it is, or
    the leading elements of a flat, padded ZeRO leaf. A window sum that this run keeps
    per device but stage 2 kept as a flat shard of the global sum goes to device 0's
    row (the rows are summed over the devices when the window ends)."""
    value = np.asarray(saved.addressable_data(0))  # read replicated on every process
    if value.shape != like.shape:
        flat = value.reshape(-1)
        param = run.get("params/" + name.removeprefix("window/grads/"))
        rows = (
            name.startswith("window/grads/")
            and param is not None
            and like.shape == (len(value), *param.shape)
        )
        if rows:
            value = np.zeros(like.shape, value.dtype)
            value[0] = flat[: math.prod(param.shape)].reshape(param.shape)
        else:
            value = flat[: math.prod(like.shape)].reshape(like.shape)
    value = value.astype(like.dtype)
    return jax.make_array_from_callback(like.shape, like.sharding, lambda index: value[index])

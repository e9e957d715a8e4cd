"""A function on every device of the mesh: ``shard_map``, or the legacy ``pmap``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from ._mesh import mark_varying
from ._options import StepOptions


def to_varying(o: StepOptions) -> Callable[[Any], Any]:
    """Marks replicated values per-device (shard_map); pmap does not track replication.
    Values already per-device (a block of a leaf split at ZeRO stage 3) stay as they are;
    under HSDP a block varies over the shard axis and is marked over the replica axis."""
    if o.parallel.strategy == "shard_map":
        axes = o.batch_axes
        return functools.partial(_to_varying, axes=axes if isinstance(axes, tuple) else (axes,))
    return _identity


def _to_varying(tree: Any, axes: tuple[str, ...]) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    missing = [tuple(a for a in axes if a not in jax.typeof(x).mat.varying) for x in leaves]
    if all(m == axes for m in missing):
        return mark_varying(tree, axes)  # stages 0 to 2: one pcast of the tree
    return treedef.unflatten(
        [mark_varying(x, m) if m else x for x, m in zip(leaves, missing, strict=True)]
    )


def mesh_map(o: StepOptions, fn: Callable[..., Any], in_specs: Any, out_specs: Any):
    """``fn`` on every device of the mesh: ``shard_map``, or the legacy ``pmap`` made to
    give each device the same blocks (a leaf split by its leading axis arrives as this
    device's rows, replicated ones whole). Manual over the data axes only: the model axes
    (``Parallel.model_axes``) are XLA's, which partitions ``fn`` over them as the
    arguments' shardings say (the model's own tensor parallelism)."""
    if o.parallel.strategy == "shard_map":
        axes = o.batch_axes if isinstance(o.batch_axes, tuple) else (o.batch_axes,)
        return jax.shard_map(
            fn,
            mesh=o.device_mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=frozenset(axes),
            check_vma=True,
        )
    n = o.num_devices

    def call(*args):
        # pmap is given flat leaves and an axis per leaf: with an empty pytree (a None
        # model state) among its arguments, jax 0.10.2's pmap misaligned the in_axes of
        # the arguments after it (the batch's first leaf went unsplit).
        outputs = jax.shard_map(
            fn, mesh=o.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
        like = jax.eval_shape(outputs, *args)
        leaves, tree = jax.tree.flatten(args)
        split_in = jax.tree.leaves(_split(in_specs, args))
        out_tree = jax.tree.structure(like)
        split_out = jax.tree.leaves(_split(out_specs, like))

        def flat(*xs):
            return out_tree.flatten_up_to(fn(*tree.unflatten(xs)))

        mapped = jax.pmap(
            flat,
            o.axis_name,
            in_axes=tuple(0 if s else None for s in split_in),
            out_axes=[0 if s else None for s in split_out],
            devices=list(o.mesh.devices.flat),
        )
        leaves = [
            x.reshape(n, -1, *x.shape[1:]) if s else x
            for x, s in zip(leaves, split_in, strict=True)
        ]
        out = mapped(*leaves)
        return out_tree.unflatten(
            [x.reshape(-1, *x.shape[2:]) if s else x for x, s in zip(out, split_out, strict=True)]
        )

    return call


def _split(specs: Any, tree: Any) -> Any:
    """Per leaf of ``tree``: whether its spec (a prefix of it) splits it over the mesh."""
    return jax.tree.map(
        lambda s, x: jax.tree.map(lambda _: s != P(), x), specs, tree, is_leaf=is_spec
    )


def is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _identity(x: Any) -> Any:
    return x

"""ZeRO stages 1 and 2 on the data axis: how the trainable parameters are cut into
per-device shards, and the two collectives that move gradients and parameters.

Layout (docs/decisions.md, "ZeRO on the data axis"): every trainable leaf is
flattened and zero-padded to a multiple of ``num_devices``; device ``r`` owns
elements ``[r * c, (r + 1) * c)`` of it, ``c = ceil(size / num_devices)``.
The optimizer sees a tree of the same structure whose leaves are these flat
shards, and its per-parameter state is laid out the same way, so elementwise
optimizers update each element exactly as they would the whole leaf. On the
wire the leaves' rows are packed side by side, so one reduce-scatter carries
every gradient and one all-gather per parameter dtype every parameter.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def _gather(x: jax.Array, axis_name: str) -> jax.Array:
    """``all_gather``, Varying -> Invariant, so the gathered parameters leave shard_map
    replicated: ``to="invarying"`` from jax 0.11, a private function in 0.10.2."""
    if "to" in inspect.signature(jax.lax.all_gather).parameters:
        return jax.lax.all_gather(x, axis_name, to="invarying")
    from jax._src.lax.parallel import all_gather_invariant

    return all_gather_invariant(x, axis_name)


class ShardLayout:
    """Where each element of the trainable leaves lives on a mesh of ``num_devices``.

    Built from the trainable tree (frozen leaves are ``optax.MaskedNode()``:
    no leaves, no shard). Shapes and dtypes are read, never values.
    """

    def __init__(self, trainable: Any, num_devices: int):
        leaves, self.treedef = jax.tree.flatten(trainable)
        self.num_devices = num_devices
        self.shapes = [tuple(x.shape) for x in leaves]
        self.dtypes = [jnp.dtype(x.dtype) for x in leaves]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.chunks = [-(-s // num_devices) for s in self.sizes]

    def _rows(self, x: jax.Array, chunk: int) -> jax.Array:
        """``x`` flat, zero-padded to ``num_devices * chunk``, as ``[num_devices, chunk]``."""
        flat = x.reshape(-1)
        flat = jnp.pad(flat, (0, self.num_devices * chunk - flat.size))
        return flat.reshape(self.num_devices, chunk)

    def padded(self, tree: Any) -> Any:
        """The whole-mesh view: every leaf flat and padded, ``[num_devices * c]``; split
        over the mesh (``P(axis)``) each device holds its shard."""
        leaves = self.treedef.flatten_up_to(tree)
        return self.treedef.unflatten(
            [self._rows(x, c).reshape(-1) for x, c in zip(leaves, self.chunks, strict=True)]
        )

    def shard(self, tree: Any, index: jax.Array) -> Any:
        """Device ``index``'s shard of every (whole, replicated) leaf: ``[c]`` each."""
        leaves = self.treedef.flatten_up_to(tree)
        return self.treedef.unflatten(
            [
                jax.lax.dynamic_index_in_dim(self._rows(x, c), index, keepdims=False)
                for x, c in zip(leaves, self.chunks, strict=True)
            ]
        )

    def shard_like(self, tree: Any) -> Any:
        """Shapes and dtypes of one device's shard of ``tree``."""
        leaves = self.treedef.flatten_up_to(tree)
        return self.treedef.unflatten(
            [jax.ShapeDtypeStruct((c,), x.dtype) for x, c in zip(leaves, self.chunks, strict=True)]
        )

    def reduce_scatter(self, tree: Any, axis_name: str, wire: Any = None) -> Any:
        """ONE reduce-scatter of every leaf: each device gets the global sum of its shard.

        ``wire`` (e.g. bfloat16) is the dtype on the wire: the sums are divided by
        ``num_devices`` before the cast and multiplied back after, as torch's
        ``bf16_compress_hook`` divides before it compresses, so large sums do not
        overflow the narrow type.
        """
        leaves = self.treedef.flatten_up_to(tree)
        dtype = leaves[0].dtype if leaves else jnp.float32
        rows = [self._rows(x, c) for x, c in zip(leaves, self.chunks, strict=True)]
        buffer = jnp.concatenate(rows, axis=1) if rows else jnp.zeros((self.num_devices, 0))
        buffer = compress(buffer, wire, self.num_devices)
        summed = jax.lax.psum_scatter(buffer, axis_name, scatter_dimension=0, tiled=False)
        summed = decompress(summed, dtype, wire, self.num_devices)
        return self.treedef.unflatten(_split(summed, self.chunks))

    def all_gather(self, shards: Any, axis_name: str) -> Any:
        """The whole leaves from every device's shard: one all-gather per dtype."""
        leaves = self.treedef.flatten_up_to(shards)
        out: list[Any] = [None] * len(leaves)
        for dtype in sorted({str(x.dtype) for x in leaves}):
            which = [i for i, x in enumerate(leaves) if str(x.dtype) == dtype]
            chunks = [self.chunks[i] for i in which]
            gathered = _gather(jnp.concatenate([leaves[i] for i in which]), axis_name)
            for i, rows in zip(which, _split(gathered, chunks, axis=1), strict=True):
                out[i] = rows.reshape(-1)[: self.sizes[i]].reshape(self.shapes[i])
        return self.treedef.unflatten(out)


def _split(x: jax.Array, chunks: list[int], axis: int = 0) -> list[jax.Array]:
    bounds = [sum(chunks[:i]) for i in range(1, len(chunks))]
    return jnp.split(x, bounds, axis=axis)


def compress(x: jax.Array, wire: Any, num_devices: int) -> jax.Array:
    """``x / num_devices`` in ``wire`` (no-op without one)."""
    if wire is None:
        return x
    return (x / jnp.asarray(num_devices, x.dtype)).astype(wire)


def decompress(x: jax.Array, dtype: Any, wire: Any, num_devices: int) -> jax.Array:
    """Back in ``dtype``, times ``num_devices``: the sum again, to the wire's precision."""
    if wire is None:
        return x
    return x.astype(dtype) * jnp.asarray(num_devices, dtype)


def sharded_leaves(init: Callable[[Any], Any], layout: ShardLayout, trainable: Any) -> Any:
    """Per leaf of ``init``'s state: True where it follows the parameters' shards.

    Found by initializing abstractly on two shard sizes: a leaf whose shape
    moves with the shard (momentum, Adam's moments) is per parameter and split
    over the mesh; one that does not (a step count, a schedule's state) is
    shared and replicated.
    """

    def like(extra: int) -> Any:
        leaves = layout.treedef.flatten_up_to(trainable)
        return layout.treedef.unflatten(
            [
                jax.ShapeDtypeStruct((layout.num_devices * (c + extra),), x.dtype)
                for x, c in zip(leaves, layout.chunks, strict=True)
            ]
        )

    small, large = jax.eval_shape(init, like(0)), jax.eval_shape(init, like(1))
    return jax.tree.map(lambda a, b: a.shape != b.shape, small, large)


def specs_of(flags: Any, axis_name: str) -> Any:
    """``P(axis_name)`` for sharded leaves, ``P()`` for shared ones."""
    return jax.tree.map(lambda f: P(axis_name) if f else P(), flags)

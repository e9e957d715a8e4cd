"""Replicas that must be identical: a check that every device holds the same copy."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


class ReplicaMismatchError(ValueError):
    """Replicas of a value that must be identical on every device differ."""


def _bits(x: jax.Array) -> jax.Array:
    """An integer view with the same bits, so -0.0 != 0.0 and NaN == NaN."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return _bits(jnp.stack([x.real, x.imag]))
    return x.astype(jnp.int32) if x.dtype == jnp.bool_ else x


@functools.lru_cache(maxsize=8)
def _replica_check(mesh: Mesh) -> Any:
    """The jitted check for ``mesh``, built once: jit then compiles once per set of
    shapes, not at every ``TrainStep.init`` (a compile of over a second on 4 CPU devices)."""
    axis = mesh.axis_names[0]

    def differs(*xs):
        first = jax.lax.axis_index(axis) == 0
        flags = []
        for x in xs:
            bits = _bits(x)
            ref = jax.lax.psum(jnp.where(first, bits, jnp.zeros_like(bits)), axis)
            # Gathered so the flags are replicated, hence readable on any process.
            flags.append(jax.lax.all_gather(jnp.any(bits != ref), axis))
        return flags

    # check_vma=False: each device must read its OWN copy of a "replicated"
    # input; that is the thing being checked.
    return jax.jit(jax.shard_map(differs, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))


def check_replicas(tree: Any, mesh: Mesh, *, name: str = "params") -> None:
    """Checks that every device holds bitwise the same copy of ``tree``.

    Broadcasts each leaf from replica 0 (a psum where only device 0 contributes)
    and compares each device's own copy with it. Costs one collective per leaf;
    run it once when training starts, not per step.

    Raises:
      ReplicaMismatchError: naming the first differing leaf and the devices.
    """
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves or mesh.devices.size == 1:  # one device, one copy: nothing to compile
        return
    flags = _replica_check(mesh)(*[leaf for _, leaf in leaves])
    for (path, _), flag in zip(leaves, flags, strict=True):
        per_device = np.asarray(flag)
        if per_device.any():
            devices = [int(d) for d in np.flatnonzero(per_device)]
            raise ReplicaMismatchError(
                f"{name}{jax.tree_util.keystr(path)} differs between replicas: "
                f"mesh device(s) {devices} hold other values than device 0; "
                "initialize every process from the same seed or broadcast the values"
            )

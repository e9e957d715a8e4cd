"""Devices and the one-axis data mesh."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ._checks import is_integer

DATA_AXIS = "data"
"""Name of the mesh axis the batch is split over."""

_FORCE_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def emulate_cpu_devices(num_devices: int) -> None:
    """Makes the CPU backend expose ``num_devices`` devices.

    Must run before JAX starts its backend (before the first array is made or
    ``jax.devices()`` is called). Calling it again with the count the backend
    already has is a no-op, so scripts and tests can both call it.

    Raises:
      ValueError: ``num_devices`` is not a positive integer.
      RuntimeError: the backend already started with another device count.
    """
    if not is_integer(num_devices) or num_devices < 1:
        raise ValueError(f"num_devices={num_devices!r} must be a positive integer")
    num_devices = int(num_devices)
    try:
        jax.config.update("jax_num_cpu_devices", num_devices)
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have != num_devices:
            raise RuntimeError(
                f"emulate_cpu_devices(num_devices={num_devices}) was called after "
                f"the JAX backend started with {have} CPU device(s); call it right "
                "after `import jax`, before any array is created, or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={num_devices} "
                "before starting Python"
            ) from None
    # An XLA_FLAGS count wins over the config option inside XLA, so keep them
    # consistent (only once the count is in force: child processes inherit it).
    flags = os.environ.get("XLA_FLAGS", "")
    match = _FORCE_FLAG.search(flags)
    if match and int(match.group(1)) != num_devices:
        os.environ["XLA_FLAGS"] = _FORCE_FLAG.sub(
            f"--xla_force_host_platform_device_count={num_devices}", flags
        )


def data_mesh(
    num_devices: int | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_name: str = DATA_AXIS,
) -> Mesh:
    """A one-axis mesh over the first ``num_devices`` devices (all by default).

    Devices keep ``jax.devices()`` order, which is global and identical on
    every process, so mesh position ``r`` is data-parallel rank ``r``.

    Raises:
      ValueError: ``num_devices`` is not a positive integer or exceeds the devices
        there are.
    """
    available = list(jax.devices() if devices is None else devices)
    if num_devices is None:
        num_devices = len(available)
    if not is_integer(num_devices) or num_devices < 1:
        raise ValueError(f"num_devices={num_devices!r} must be a positive integer")
    num_devices = int(num_devices)
    if num_devices > len(available):
        kind = available[0].platform if available else "none"
        raise ValueError(
            f"num_devices={num_devices} exceeds the {len(available)} available "
            f"{kind} device(s); on CPU, emulate more with "
            f"jaxdp.emulate_cpu_devices({num_devices}) before JAX starts"
        )
    if jax.process_count() > 1 and num_devices != len(available):
        raise ValueError(
            f"num_devices={num_devices} must use all {len(available)} devices "
            f"when running on {jax.process_count()} processes"
        )
    return Mesh(available[:num_devices], (axis_name,))


def place(tree: Any, sharding: NamedSharding, *, copy: bool = False) -> Any:
    """Puts host or device values on the mesh with ``sharding``.

    Host values are each process's local data (for a replicated sharding: the
    whole value), so this works unchanged across processes. ``copy`` gives
    device values fresh buffers, so donating the result never deletes arrays
    the caller still holds.
    """

    leaves, treedef = jax.tree.flatten(tree)
    moved = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array) and (copy or not x.sharding.is_equivalent_to(sharding, x.ndim))
    ]
    out = [
        x
        if isinstance(x, jax.Array)
        else jax.make_array_from_process_local_data(sharding, np.asarray(x))
        for x in leaves
    ]
    if moved:
        # One program for every device leaf (a program per leaf shape compiled a model's
        # init as often as it has shapes). Not device_put(may_alias=False): it still
        # reuses the buffer of a shard that stays on the same device (jax 0.10.2).
        copies = jax.jit(_copies, out_shardings=sharding)(tuple(leaves[i] for i in moved))
        for i, x in zip(moved, copies, strict=True):
            out[i] = x
    return treedef.unflatten(out)


def _copies(xs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return tuple(jnp.copy(x) for x in xs)


@jax.jit
def copied(tree: Any) -> Any:
    """Fresh buffers of every array in ``tree``, each laid out as its original (one call):
    values a caller may keep and change while the originals are donated to a step."""
    return jax.tree.map(jnp.copy, tree)


def place_batch(batch: Any, sharding: NamedSharding) -> Any:
    """Places host or device rows on the mesh; abstract leaves keep their own sharding,
    or take ``sharding``."""
    abstract = [isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(batch)]
    if any(abstract):
        return jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
                if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None
                else x
            ),
            batch,
        )
    return place(batch, sharding)


def mark_varying(tree: Any, axis_name: str | tuple[str, ...] = DATA_AXIS) -> Any:
    """Marks replicated values as per-device inside ``shard_map(check_vma=True)``.

    Differentiating w.r.t. such values gives each device its LOCAL gradient;
    w.r.t. the unmarked (invariant) values JAX would psum the gradient itself.
    """
    return jax.lax.pcast(tree, axis_name, to="varying")


def psum(tree: Any, axes: str | tuple[str, ...]) -> Any:
    """``jax.lax.psum`` of ``tree`` over the mesh axes ``axes``: jaxdp's reductions over
    its data axes. Over axes of one device in all on a mesh of more (a data axis of size 1
    beside a model axis: tensor parallelism alone) the sum is each value itself, marked
    invariant over ``axes`` by an all-gather of one device. jax lowers no manual region
    for manual axes of one device, and XLA's SPMD partitioner refuses the all-reduce that
    ``psum`` lowers to outside one while a model axis splits the program ("Cross-partition
    allreduce must be in (partial) manual partitioning mode", jax 0.10 and 0.12)."""
    mesh = jax.sharding.get_abstract_mesh()  # empty under pmap
    if jax.lax.axis_size(axes) > 1 or mesh.empty or mesh.size == 1:
        return jax.lax.psum(tree, axes)
    return jax.tree.map(lambda x: jax.lax.all_gather(x, axes, to="invarying")[0], tree)

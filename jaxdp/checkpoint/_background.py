"""What a background save does beside the step, on one process or several.

``save`` copies the state off the devices and returns; a thread then takes the SHA-256s,
writes, reads back and prunes. Nothing in that thread may run a device collective or
read JAX's preemption sync point: both are calls every process must make in the same
order as the step's own, and the step runs meanwhile. So the thread writes through
orbax's ``Checkpointer`` with ``MultiprocessingOptions(active_processes=...)``, whose
barriers are the JAX distributed client's (a key-value service, the ones orbax's own
async commit thread waits at), never ``CheckpointManager.save``, which reads the
preemption sync point on every call, nor orbax's default barriers, which are device
programs. Whether every process read its part back is told through the same client's
key-value store, so a failure on one process is an answer on process 0, not a barrier
that never passes.

A leaf split over the processes (ZeRO's shards, a window's per-device sums) has no
whole value on any host: its copy is this process's blocks (:class:`Shards`), put back
on their devices as an array for orbax to write, which writes each process's blocks.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


@dataclasses.dataclass(frozen=True, eq=False)
class Shards:
    """A leaf split over processes, as this process holds it in host memory.

    Attributes:
        shape: the whole array's shape.
        dtype: its dtype.
        sharding: where it lies (the same on every process).
        blocks: ``(device, block)`` for each of this process's devices, the block a host copy.
    """

    shape: tuple[int, ...]
    dtype: Any
    sharding: jax.sharding.Sharding
    blocks: tuple[tuple[Any, np.ndarray], ...]

    def on_devices(self) -> jax.Array:
        """The array again (this process's blocks on their devices), for orbax to write."""
        arrays = [jax.device_put(block, device) for device, block in self.blocks]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, arrays)

    def abstract(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=self.sharding)


def on_host(tree: Any) -> Any:
    """Every array of ``tree`` in host memory, the transfers started together (orbax's
    async save does the same): a whole value where this process sees one (fully
    addressable, or replicated), this process's blocks (:class:`Shards`) where the leaf
    is split over processes. On a GPU each is a copy; on a CPU device ``np.asarray`` is
    a view of the array's buffer, which stays valid: JAX does not donate a buffer a host
    view holds (the step that donates the state then computes into new ones)."""
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            shard.data.copy_to_host_async()

    def host(x: jax.Array) -> np.ndarray | Shards:
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        blocks = tuple((s.device, np.asarray(s.data)) for s in x.addressable_shards)
        return Shards(x.shape, x.dtype, x.sharding, blocks)

    return jax.tree.map(host, tree)


def to_write(tree: Any) -> Any:
    """``tree`` (:func:`on_host`'s) as orbax writes it: split leaves as arrays again."""
    return jax.tree.map(lambda x: x.on_devices() if isinstance(x, Shards) else x, tree)


def to_read(tree: Any) -> Any:
    """What to read ``tree`` back into: host arrays as themselves, split leaves into their
    sharding (each process reads its blocks)."""
    return jax.tree.map(lambda x: x.abstract() if isinstance(x, Shards) else x, tree)


def writer(directory: Any, name: str) -> ocp.Checkpointer:
    """An orbax ``Checkpointer`` safe beside the step: its barriers between all processes
    are the distributed client's, named after ``name`` (unique to one save)."""
    options = ocp.options.MultiprocessingOptions(
        primary_host=0,
        active_processes=set(range(jax.process_count())),
        barrier_sync_key_prefix=barrier_prefix(directory, name),
    )
    handler = ocp.CompositeCheckpointHandler(  # it creates the temporary directory: its too
        composite_options=ocp.CompositeOptions(multiprocessing_options=options)
    )
    return ocp.Checkpointer(handler, multiprocessing_options=options)


def barrier_prefix(directory: Any, name: str) -> str:
    """``jaxdp_<directory's CRC-32>_<name>``: two directories' saves never share a barrier."""
    return f"jaxdp_{zlib.crc32(str(directory).encode()):08x}_{name}"


def all_read_back(directory: Any, name: str, error: str | None) -> list[str]:
    """Tells process 0 whether this process read its part of the save back (``error``:
    why not, None: it did); on process 0 returns every other process's error (empty: all
    read theirs back), on the others []. Through the distributed client's key-value store,
    which waits for a process still reading (up to orbax's coordination timeout) and
    answers for one that died (an error)."""
    if jax.process_index() != 0:
        _tell(directory, f"{name}/read_back/{jax.process_index()}", error)
        return []
    others = range(1, jax.process_count())
    said = [(i, _heard(directory, f"{name}/read_back/{i}")) for i in others]
    return [f"process {i}: {text}" for i, text in said if text]


def ended(directory: Any, name: str, error: str | None) -> str | None:
    """Process 0's word that the save ended (``error``: how it failed, None: written,
    read back everywhere and pruned), given on process 0 and returned on every process:
    no process's save ends before process 0 pruned behind it, so all list the same."""
    if jax.process_index() == 0:
        for i in range(1, jax.process_count()):
            _tell(directory, f"{name}/ended/{i}", error)
        return error
    return _heard(directory, f"{name}/ended/{jax.process_index()}") or None


def _tell(directory: Any, key: str, error: str | None) -> None:
    client = ocp.multihost.get_jax_distributed_client()
    client.key_value_set(f"{barrier_prefix(directory, key)}", error or "")


def _heard(directory: Any, key: str) -> str:
    """What another process told under ``key`` ("": all is well), waiting for it up to
    orbax's coordination timeout; a process gone or silent is an error."""
    client = ocp.multihost.get_jax_distributed_client()
    timeout_ms = ocp.multihost.coordination_timeout() * 1000
    try:
        return client.blocking_key_value_get(barrier_prefix(directory, key), timeout_ms)
    except Exception as e:  # noqa: BLE001 - no answer is the answer
        return f"no word ({type(e).__name__}: {str(e)[:200]})"

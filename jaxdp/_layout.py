"""Batch sizes and the layout of a global batch over devices and micro-batches.

A global batch is one array whose leading axis has ``global_batch_size`` rows,
device-major: row ``(r * accum_steps + j) * micro_batch_size + i`` is sample
``i`` of micro-batch ``j`` on device ``r``. Device ``r`` therefore holds exactly
what DDP rank ``r`` feeds through its ``accum_steps`` micro-batches.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import jax
import numpy as np

from ._checks import is_integer
from ._sampler import DistributedSampler, Permutation, numpy_permutation

if TYPE_CHECKING:
    from jax.sharding import Mesh


class BatchSizes(NamedTuple):
    """``global_batch_size == num_devices * accum_steps * micro_batch_size``."""

    num_devices: int
    accum_steps: int
    micro_batch_size: int
    global_batch_size: int

    def describe(self) -> str:
        """The identity with its numbers, as jaxdp's logs and errors print it."""
        return (
            f"global_batch_size={self.global_batch_size} = num_devices={self.num_devices}"
            f" x accum_steps={self.accum_steps} x micro_batch_size={self.micro_batch_size}"
        )


def batch_sizes(
    *,
    num_devices: int,
    accum_steps: int = 1,
    micro_batch_size: int | None = None,
    global_batch_size: int | None = None,
) -> BatchSizes:
    """Completes and checks the batch identity from either batch size.

    Raises:
      ValueError: a size is not positive, neither or inconsistent batch sizes
        are given, or ``global_batch_size`` does not divide by
        ``num_devices * accum_steps``.
    """
    for name, value in (("num_devices", num_devices), ("accum_steps", accum_steps)):
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    for name, value in (
        ("micro_batch_size", micro_batch_size),
        ("global_batch_size", global_batch_size),
    ):
        if value is not None and not is_integer(value):
            raise ValueError(f"{name}={value!r} must be a positive integer")
    num_devices, accum_steps = int(num_devices), int(accum_steps)
    if global_batch_size is not None:
        global_batch_size = int(global_batch_size)
    if micro_batch_size is not None:
        micro_batch_size = int(micro_batch_size)
    per_step = num_devices * accum_steps
    if global_batch_size is not None:
        if global_batch_size < 1 or global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={global_batch_size} must be a positive multiple of "
                f"num_devices * accum_steps = {num_devices} * {accum_steps}"
            )
        derived = global_batch_size // per_step
        if micro_batch_size is not None and micro_batch_size != derived:
            raise ValueError(
                f"micro_batch_size={micro_batch_size} contradicts global_batch_size="
                f"{global_batch_size} / (num_devices * accum_steps = {num_devices} * "
                f"{accum_steps}) = {derived}"
            )
        micro_batch_size = derived
    if micro_batch_size is None:
        raise ValueError("give micro_batch_size or global_batch_size")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be at least 1")
    return BatchSizes(num_devices, accum_steps, micro_batch_size, per_step * micro_batch_size)


LastWindow = Literal["drop", "step"]
"""What an epoch's last, incomplete accumulation window does: ``"drop"`` or one more
``"step"`` weighted by its real size (:func:`epoch_schedule`)."""


class EpochSchedule(NamedTuple):
    """The optimizer steps of one epoch.

    ``rows[s]`` are the dataset indices of step ``s`` (``global_batch_size`` of
    them, device-major: device ``r``'s ``accum_steps`` micro-batches in order);
    ``micro_weights[s]`` holds one weight per micro-batch of that step: 1, or 0
    for the padding that fills an incomplete last window.
    """

    rows: np.ndarray  # [steps, global_batch_size] int
    micro_weights: np.ndarray  # [steps, accum_steps] float32


def epoch_schedule(
    dataset_size: int,
    sizes: BatchSizes,
    *,
    epoch: int = 0,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    permutation: Permutation = numpy_permutation,
    last_window: LastWindow = "drop",
) -> EpochSchedule:
    """Dataset indices of every optimizer step of one epoch, with micro-batch weights.

    Rank ``r`` is mesh device ``r`` with the sampler of
    :class:`DistributedSampler` (``num_replicas = num_devices``); its indices
    are cut into micro-batches of ``micro_batch_size`` in order (a last partial
    micro-batch is dropped, like ``DataLoader(drop_last=True)``), and
    ``accum_steps`` consecutive micro-batches make one optimizer step.

    ``last_window`` decides the ``m < accum_steps`` micro-batches left at the
    end of the epoch: ``"drop"`` (default) leaves them out, so every step sees
    exactly ``global_batch_size`` samples; ``"step"`` makes one more step of
    them, weighted by its real size (the mean over its ``num_devices * m``
    micro-batches, not a ``1 / accum_steps`` share), padded to the full shape
    with weight-0 copies so the step does not recompile.
    """
    n, k, b = sizes.num_devices, sizes.accum_steps, sizes.micro_batch_size
    if last_window not in ("drop", "step"):
        raise ValueError(f"last_window={last_window!r} must be 'drop' or 'step'")
    per_rank = []
    for rank in range(n):
        sampler = DistributedSampler(
            dataset_size,
            num_replicas=n,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            permutation=permutation,
        )
        sampler.set_epoch(epoch)
        per_rank.append(sampler.indices())
    micro = len(per_rank[0]) // b
    steps, left = divmod(micro, k)
    if last_window == "drop":
        left = 0
    if steps + (left > 0) == 0:
        raise ValueError(
            f"dataset_size={dataset_size} gives each of num_devices={n} ranks "
            f"{len(per_rank[0])} samples, fewer than one optimizer step needs "
            f"(accum_steps * micro_batch_size = {k} * {b})"
        )
    weights = np.ones((steps + (left > 0), k), np.float32)
    # [ranks, micro-batches, b]; the padding repeats the window's first micro-batch.
    blocks = np.stack([idx[: micro * b].reshape(micro, b) for idx in per_rank])
    blocks = blocks[:, : steps * k + left]
    if left:
        pad = np.repeat(blocks[:, steps * k : steps * k + 1], k - left, axis=1)
        blocks = np.concatenate([blocks, pad], axis=1)
        weights[-1, left:] = 0
    rows = blocks.reshape(n, -1, k * b).transpose(1, 0, 2).reshape(-1, n * k * b)
    return EpochSchedule(rows, weights)


def micro_batches(batch: Any, sizes: BatchSizes) -> list[Any]:
    """Splits a global batch into ``accum_steps`` global micro-batches.

    Micro-batch ``j`` has ``num_devices * micro_batch_size`` rows, device-major,
    and holds micro-batch ``j`` of every device: what the ``multisteps`` path
    takes per call.
    """
    n, k, b = sizes.num_devices, sizes.accum_steps, sizes.micro_batch_size
    check_rows(batch, sizes.global_batch_size, sizes.describe())

    def take(x: Any, j: int) -> Any:
        x = np.asarray(x)
        return x.reshape(n, k, b, *x.shape[1:])[:, j].reshape(n * b, *x.shape[1:])

    return [jax.tree.map(lambda x, j=j: take(x, j), batch) for j in range(k)]


class ProcessShare(NamedTuple):
    """The part of every global batch that one process feeds.

    In the device-major layout a process whose devices are mesh positions
    ``ranks`` owns the contiguous rows ``rows`` of a global batch (and of a
    global micro-batch: ``micro_rows``); they are themselves a device-major
    batch of the batch identity ``sizes`` (``num_devices = len(ranks)``).
    """

    process_index: int
    process_count: int
    ranks: range  # data-parallel ranks (mesh positions) of this process's devices
    rows: slice  # its rows of a global batch
    micro_rows: slice  # its rows of a global micro-batch (the multisteps path's calls)
    sizes: BatchSizes  # the process-local identity: its devices x accum_steps x micro_batch_size


def process_share(
    mesh: Mesh,
    sizes: BatchSizes,
    *,
    process_index: int | None = None,
    model_axes: tuple[str, ...] = (),
) -> ProcessShare:
    """What process ``process_index`` (default: this one) reads of each global batch.

    Device ``r`` of the mesh is data-parallel rank ``r`` (its own
    :class:`DistributedSampler` rank, as one DDP rank per GPU); a process reads
    the rows of its devices' ranks and nothing else. One process: everything.
    ``model_axes`` (``Parallel.model_axes``): the mesh's other axes, whose devices of a
    data rank read the same rows; a rank is then the mesh's position along its data
    axis, and its devices must belong to one process.

    Raises:
      ValueError: ``sizes.num_devices`` is not the size of the mesh's data axis, or
        the process's ranks are not one contiguous block of the mesh, or the
        processes hold different numbers of them.
    """
    data = [a for a in mesh.axis_names if a not in model_axes]
    grid = np.moveaxis(mesh.devices, [mesh.axis_names.index(a) for a in data], range(len(data)))
    ranks_devices = grid.reshape(math.prod(grid.shape[: len(data)]), -1)
    if sizes.num_devices != len(ranks_devices):
        unit = "devices" if not model_axes else f"data ranks (devices along {tuple(data)})"
        raise ValueError(
            f"sizes.num_devices={sizes.num_devices} must be the mesh's {len(ranks_devices)} {unit}"
        )
    owners = []
    for rank, devices in enumerate(ranks_devices):
        processes = sorted({d.process_index for d in devices})
        if len(processes) > 1:
            raise ValueError(
                f"data rank {rank}'s devices {[d.id for d in devices]} belong to processes "
                f"{processes}: a rank's model-axis devices must belong to one process"
            )
        owners.append(processes[0])
    if process_index is None:
        process_index = jax.process_index()
    ranks = [r for r, owner in enumerate(owners) if owner == process_index]
    counts = {p: owners.count(p) for p in owners}
    if not ranks or ranks != list(range(ranks[0], ranks[-1] + 1)) or len(set(counts.values())) > 1:
        raise ValueError(
            f"process {process_index} must own one contiguous block of the mesh's devices, "
            f"the same number as every process, to feed its rows of the device-major batch; "
            f"the mesh's devices belong to processes {owners} (build the mesh from "
            "jax.devices(), which is ordered by process)"
        )
    first, n = ranks[0], len(ranks)
    k, b = sizes.accum_steps, sizes.micro_batch_size
    local = BatchSizes(n, k, b, n * k * b)
    return ProcessShare(
        process_index,
        len(counts),
        range(first, first + n),
        slice(first * k * b, (first + n) * k * b),
        slice(first * b, (first + n) * b),
        local,
    )


def call_sizes(
    batch: Any,
    *,
    path: Literal["fused", "multisteps"],
    num_devices: int,
    accum_steps: int,
    process_count: int = 1,
) -> BatchSizes:
    """The (global) batch identity of ``batch`` as one call of a step takes it.

    ``fused``: a global batch (``global_batch_size`` rows); ``multisteps``: a
    global micro-batch (``num_devices * micro_batch_size`` rows). A
    ``jax.Array`` leaf counts with its (global) shape. Host data (numpy) is this
    process's part: with several processes, its rows of the device-major global
    batch (:func:`process_share`), the same number on every process, so the
    global batch has ``process_count`` times as many.

    Raises:
      TypeError: a leaf is not an array (a batch of Python lists), naming it.
      ValueError: naming the rule and the numbers it breaks.
    """
    leaves = jax.tree.leaves(batch)
    shapes = [getattr(x, "shape", ()) for x in leaves]
    if not all(shapes):
        _refuse_leaf(batch)
    local = {shape[0] for shape in shapes}
    scale = {1 if isinstance(x, jax.Array) else process_count for x in leaves}
    if len(local) != 1:
        raise ValueError(f"every batch leaf needs the same leading size, got {sorted(local)}")
    if len(scale) != 1:
        raise ValueError(
            "with several processes, a batch must be all host arrays (this process's rows) "
            "or all jax.Arrays (global), not a mix"
        )
    ((rows,), (factor,)) = local, scale
    total = rows * factor
    try:
        if path == "fused":
            return batch_sizes(
                num_devices=num_devices, accum_steps=accum_steps, global_batch_size=total
            )
        if total < 1 or total % num_devices:
            raise ValueError(
                f"a multisteps call takes one global micro-batch of num_devices * "
                f"micro_batch_size rows: {total} rows must be a positive multiple of "
                f"num_devices={num_devices} (the accum_steps={accum_steps} "
                "micro-batches of a step come in separate calls)"
            )
        return batch_sizes(
            num_devices=num_devices,
            accum_steps=accum_steps,
            micro_batch_size=total // num_devices,
        )
    except ValueError as e:
        if total == rows:
            raise
        raise ValueError(
            f"this process's batch has {rows} rows; {process_count} processes make "
            f"a global batch of {total} rows: {e}"
        ) from None


def _refuse_leaf(batch: Any) -> None:
    """Raises for the first leaf of ``batch`` without a leading axis of rows."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        name = "batch" + jax.tree_util.keystr(path)
        if not hasattr(leaf, "shape"):
            raise TypeError(
                f"{name} is a {type(leaf).__name__}, not an array: every batch leaf must be an "
                "array with the rows on its leading axis (a batch of Python lists has a "
                "number at every leaf); pass np.asarray(...) of each"
            )
        if not leaf.shape:
            raise ValueError(f"{name} has shape (); every batch leaf needs a leading axis of rows")


def check_rows(batch: Any, rows: int, rule: str) -> None:
    """Raises unless every leaf of ``batch`` has ``rows`` rows on its leading axis."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        shape = np.shape(leaf)
        if not shape or shape[0] != rows:
            name = "batch" + jax.tree_util.keystr(path)
            raise ValueError(
                f"{name} has shape {shape}; its leading axis must have {rows} rows ({rule})"
            )

"""Batch sizes and the layout of a global batch over devices and micro-batches.

A global batch is one array whose leading axis has ``global_batch_size`` rows,
device-major: row ``(r * accum_steps + j) * micro_batch_size + i`` is sample
``i`` of micro-batch ``j`` on device ``r``. Device ``r`` therefore holds exactly
what DDP rank ``r`` feeds through its ``accum_steps`` micro-batches.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import numpy as np

from ._sampler import DistributedSampler, Permutation, numpy_permutation


class BatchSizes(NamedTuple):
    """``global_batch_size == num_devices * accum_steps * micro_batch_size``."""

    num_devices: int
    accum_steps: int
    micro_batch_size: int
    global_batch_size: int

    def describe(self) -> str:
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
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
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


def epoch_batches(
    dataset_size: int,
    sizes: BatchSizes,
    *,
    epoch: int = 0,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    permutation: Permutation = numpy_permutation,
) -> np.ndarray:
    """``epoch_schedule(..., last_window="drop").rows``: ``[steps, global_batch_size]``."""
    return epoch_schedule(
        dataset_size,
        sizes,
        epoch=epoch,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        permutation=permutation,
    ).rows


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


def check_rows(batch: Any, rows: int, rule: str) -> None:
    """Raises unless every leaf of ``batch`` has ``rows`` rows on its leading axis."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        shape = np.shape(leaf)
        if not shape or shape[0] != rows:
            name = "batch" + jax.tree_util.keystr(path)
            raise ValueError(
                f"{name} has shape {shape}; its leading axis must have {rows} rows ({rule})"
            )

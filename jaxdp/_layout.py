"""Batch sizes and the layout of a global batch over devices and micro-batches.

A global batch is one array whose leading axis has ``global_batch_size`` rows,
device-major: row ``(r * accum_steps + j) * micro_batch_size + i`` is sample
``i`` of micro-batch ``j`` on device ``r``. Device ``r`` therefore holds exactly
what DDP rank ``r`` feeds through its ``accum_steps`` micro-batches.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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
    """Dataset indices of every optimizer step of one epoch, ``[steps, global_batch]``.

    Rank ``r`` is mesh device ``r`` with the sampler of
    :class:`DistributedSampler` (``num_replicas = num_devices``); its indices
    are cut into micro-batches of ``micro_batch_size`` in order, and
    ``accum_steps`` consecutive micro-batches make one optimizer step. A tail
    too short for a whole step is dropped (each rank has the same count).
    """
    n, k, b = sizes.num_devices, sizes.accum_steps, sizes.micro_batch_size
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
    steps = len(per_rank[0]) // (k * b)
    if steps == 0:
        raise ValueError(
            f"dataset_size={dataset_size} gives each of num_devices={n} ranks "
            f"{len(per_rank[0])} samples, fewer than one optimizer step needs "
            f"(accum_steps * micro_batch_size = {k} * {b})"
        )
    ranks = np.stack([idx[: steps * k * b].reshape(steps, k * b) for idx in per_rank], 1)
    return ranks.reshape(steps, n * k * b)


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

"""A sampler with exactly the semantics of torch's DistributedSampler."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ._checks import is_integer

Permutation = Callable[[int, int], Sequence[int]]
"""``permutation(n, seed) -> a permutation of range(n)``."""


def numpy_permutation(n: int, seed: int) -> np.ndarray:
    """The default shuffle: numpy's PCG64 seeded with ``seed``.

    torch.randperm cannot be reproduced without torch; pass ``permutation=``
    a function wrapping ``torch.randperm(n, generator=g.manual_seed(seed))``
    to get torch's exact order.
    """
    return np.random.default_rng(seed).permutation(n)


class DistributedSampler:
    """Indices of one data-parallel rank, as ``torch.utils.data.DistributedSampler``.

    Per epoch: take ``permutation(dataset_size, seed + epoch)`` (or
    ``range(dataset_size)`` without shuffle); without ``drop_last`` pad it by
    wrapping its head until it divides by ``num_replicas``, with ``drop_last``
    cut the tail instead; rank ``r`` takes the strided slice
    ``[r : total_size : num_replicas]``. Every rank gets ``len(self)`` indices.

    Raises ``ValueError`` at construction (and in :meth:`set_epoch`) for sizes
    that are not positive integers, a rank outside the replicas, or a seed or
    epoch below 0.
    """

    def __init__(
        self,
        dataset_size: int,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        permutation: Permutation = numpy_permutation,
    ) -> None:
        for name, value in (("dataset_size", dataset_size), ("num_replicas", num_replicas)):
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not is_integer(rank):
            raise ValueError(f"rank={rank!r} must be an integer")
        _check_seed("seed", seed)
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank={rank} must be in [0, num_replicas - 1] = [0, {num_replicas - 1}]"
            )
        if drop_last and dataset_size < num_replicas:
            raise ValueError(
                f"dataset_size={dataset_size} with drop_last=True leaves no sample "
                f"for num_replicas={num_replicas} ranks"
            )
        self.dataset_size = dataset_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.permutation = permutation
        self.epoch = 0
        if drop_last and dataset_size % num_replicas:
            self.num_samples = math.ceil((dataset_size - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(dataset_size / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Reshuffles: epoch ``e`` uses the permutation of ``seed + e``."""
        _check_seed("epoch", epoch)
        self.epoch = epoch

    def epoch_order(self) -> np.ndarray:
        """The padded (or cut) order of all ranks before the strided split."""
        n = self.dataset_size
        if self.shuffle:
            order = np.asarray(self.permutation(n, self.seed + self.epoch), dtype=np.int64)
            if sorted(order.tolist()) != list(range(n)):
                raise ValueError(
                    f"permutation(n={n}, seed={self.seed + self.epoch}) did not "
                    f"return a permutation of range({n})"
                )
        else:
            order = np.arange(n, dtype=np.int64)
        if self.drop_last:
            return order[: self.total_size]
        padding = self.total_size - n
        reps = math.ceil(padding / n) if padding else 0
        return np.concatenate([order, np.tile(order, reps)[:padding]])

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch, in order."""
        return self.epoch_order()[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples


def _check_seed(name: str, value: int) -> None:
    # numpy's generator refuses a negative seed, and only when the epoch is drawn.
    if not is_integer(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer")

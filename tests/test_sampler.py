"""Acceptance 4: DistributedSampler and the batch layout match torch index for index."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import jaxdp


def torch_randperm(n: int, seed: int) -> list[int]:
    """The permutation torch's sampler draws for ``seed`` (= its seed + epoch)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("epoch", [0, 3])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dataset_size", [8, 10, 11, 17])
def test_matches_torch_distributed_sampler(dataset_size, world_size, shuffle, drop_last, epoch):
    for rank in range(world_size):
        theirs = TorchSampler(
            range(dataset_size),
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=7,
            drop_last=drop_last,
        )
        ours = jaxdp.DistributedSampler(
            dataset_size,
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=7,
            drop_last=drop_last,
            permutation=torch_randperm,
        )
        theirs.set_epoch(epoch)
        ours.set_epoch(epoch)
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)


def test_padding_wraps_more_than_once_like_torch():
    # 3 samples over 8 ranks: the padding repeats the whole order twice and more.
    for rank in range(8):
        theirs = TorchSampler(range(3), num_replicas=8, rank=rank, shuffle=False)
        ours = jaxdp.DistributedSampler(3, num_replicas=8, rank=rank, shuffle=False)
        assert list(ours) == list(theirs)


def test_default_shuffle_is_a_seeded_permutation_that_changes_with_epoch():
    sampler = jaxdp.DistributedSampler(50, num_replicas=1, rank=0, seed=1)
    first = list(sampler)
    assert sorted(first) == list(range(50)) and first != list(range(50))
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first


@pytest.mark.parametrize(("num_devices", "accum_steps", "micro"), [(2, 2, 3), (4, 1, 2), (3, 2, 2)])
def test_device_micro_batches_hold_ddp_rank_micro_batches(num_devices, accum_steps, micro):
    """Device r's micro-batch j of step t == DDP rank r's (t*K + j)-th DataLoader batch."""
    dataset_size, epoch = 37, 2
    sizes = jaxdp.batch_sizes(
        num_devices=num_devices, accum_steps=accum_steps, micro_batch_size=micro
    )
    steps = jaxdp.epoch_schedule(
        dataset_size, sizes, epoch=epoch, seed=5, permutation=torch_randperm
    ).rows
    for rank in range(num_devices):
        sampler = TorchSampler(range(dataset_size), num_replicas=num_devices, rank=rank, seed=5)
        sampler.set_epoch(epoch)
        loader = [
            b.tolist() for b in DataLoader(range(dataset_size), batch_size=micro, sampler=sampler)
        ]
        for t, row in enumerate(steps):
            device = row.reshape(num_devices, accum_steps, micro)[rank]
            for j in range(accum_steps):
                assert device[j].tolist() == loader[t * accum_steps + j]
    # Only whole optimizer steps: the incomplete tail of the epoch is dropped.
    assert len(steps) == len(sampler) // (accum_steps * micro)


def test_micro_batches_split_a_global_batch_per_device():
    sizes = jaxdp.batch_sizes(num_devices=2, accum_steps=3, micro_batch_size=2)
    batch = np.arange(12)
    parts = jaxdp.micro_batches(batch, sizes)
    assert [p.tolist() for p in parts] == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]

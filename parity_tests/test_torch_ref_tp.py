"""torch_ref's tensor parallelism (issue 49, item 3, the PyTorch side): ``stack``'s blocks
split by their Megatron plan over 2 ``tp`` ranks of a ``(dp 2, tp 2)`` mesh of 4 gloo
ranks, under DDP and under FSDP2 over the 2 data ranks, equal plain DDP on 2 ranks step
by step (the same data, order and update: the pin that jaxdp's tensor-parallel parity
stands on), and each rank holds half of every split weight. Imports neither jax nor
jaxdp; its runs ride in the run's shared batch (one start of 4 ranks and one of 2)."""

from __future__ import annotations

import dataclasses

import pytest
from test_torch_ref_fsdp import (
    MODEL,
    NUM_SAMPLES,
    assert_trajectory_equals_ddp,
    initial_state,
)
from test_torch_ref_fsdp import config as ddp_config

import torch_ref as tr

# PIN_RTOL's bound holds, for the same reason: the split model sums the same products in
# other groupings (RowwiseParallel's all-reduce of each rank's half of a block's output,
# the clip's norm from each tensor's halves), a few float64 roundings per step. Observed:
# at most 8.4e-16 of a tensor's largest element at K=3 (1.2e-15 at K=1, measured once),
# the same under DDP and FSDP2; the losses within 2.2e-16.
DATA_RANKS, TP = 2, 2
K = 3  # a window: the first K - 1 micro-batches under no_sync (FSDP2's, DDP's)
# (strategy, num_devices, accum_steps): TP x DDP and TP x FSDP2 on (dp 2, tp 2), and their
# pin, DDP on the 2 data ranks.
SPLIT = [(strategy, DATA_RANKS * TP, K) for strategy in ("tp_ddp", "tp_fsdp")]
# HSDP x TP: (replicate 2, shard 2, tp 2), 8 ranks, against DDP on its 4 data ranks.
HSDP = ("tp_hsdp", 2 * DATA_RANKS * TP, K)
RUNS = [*SPLIT, HSDP, ("ddp", DATA_RANKS, K), ("ddp", 2 * DATA_RANKS, K)]


def config(strategy: str, num_devices: int, accum_steps: int) -> tr.TrainConfig:
    """test_torch_ref_fsdp.py's DDP run of the cell, with tensor parallelism."""
    options = {
        "ddp": {},
        "tp_ddp": {"tp": TP},
        "tp_fsdp": {"tp": TP, "fsdp": True},
        "tp_hsdp": {"tp": TP, "fsdp": True, "shards": 2},
    }
    return dataclasses.replace(ddp_config("ddp", num_devices, accum_steps), **options[strategy])


def torch_jobs() -> dict[tuple, tuple]:
    """Every run of RUNS, keyed as there, for the run's shared batch."""
    data, state = tr.make_data(MODEL, NUM_SAMPLES), initial_state()
    return {key: (config(*key), data, state) for key in RUNS}


@pytest.fixture(scope="module")
def runs(torch_batch) -> dict[tuple, tr.Result]:
    return torch_batch[__name__]


@pytest.mark.parametrize("key", SPLIT, ids=lambda key: key[0])
def test_tensor_parallel_trajectory_equals_ddp_on_the_data_ranks(runs, key):
    # The clip acts in these runs (OPTIMIZER's comment).
    assert_trajectory_equals_ddp(runs[key], runs[("ddp", DATA_RANKS, K)])


def test_hsdp_with_tensor_parallelism_equals_ddp_on_its_data_ranks(runs):
    """FSDP2's HSDP on the (replicate 2, shard 2) submesh of a (replicate, shard, tp)
    mesh over the TP-split stack, 8 gloo ranks, equals DDP on its 4 data ranks."""
    assert_trajectory_equals_ddp(runs[HSDP], runs[("ddp", 2 * DATA_RANKS, K)])


def test_each_tp_rank_holds_half_of_every_split_weight(runs):
    """Under TP x DDP each rank holds the replicated leaves whole and half of each
    block's ``fc`` (its output rows and their bias) and ``proj`` (its input columns;
    its bias, added after the all-reduce, whole)."""
    params = initial_state()
    halved = {k for k in params if ".fc." in k or k.endswith(".proj.weight")}
    held = sum(v.nbytes // (TP if k in halved else 1) for k, v in params.items())
    assert runs[("tp_ddp", 4, K)].parameter_bytes == [held] * 4
    assert runs[("ddp", 2, K)].parameter_bytes == [sum(v.nbytes for v in params.values())] * 2
    # FSDP2 splits each of those over the 2 data ranks too: a quarter, up to padding.
    fsdp = runs[("tp_fsdp", 4, K)].parameter_bytes
    assert sum(fsdp) == 2 * held


def test_tp_options_are_checked_before_any_work():
    tp = config("tp_ddp", 4, 1)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=rf"tp={bad!r} must be a whole number"):
            dataclasses.replace(tp, tp=bad)
    with pytest.raises(ValueError, match=r"tp=3 must be a divisor of num_devices=4"):
        dataclasses.replace(tp, tp=3)
    with pytest.raises(ValueError, match=r"tp=2 needs a model with a Megatron plan: 'stack'"):
        dataclasses.replace(tp, model="mlp")
    for option in ({"zero": True}, {"comm_hook": "bf16"}, {"sync_batchnorm": True}):
        (name, value), = option.items()  # fmt: skip
        with pytest.raises(ValueError, match=rf"tp=2 with {name}={value!r} is not built"):
            dataclasses.replace(tp, **option)
    with pytest.raises(ValueError, match=r"tp=2 with shards=8: shards \(data ranks per shard"):
        dataclasses.replace(config("tp_ddp", 8, 1), fsdp=True, shards=8)
    # The data ranks read the batch: 4 ranks of tp 2 are 2 data ranks' windows.
    assert tp.data_ranks == 2
    assert tr.steps_per_epoch(tp, NUM_SAMPLES) == tr.steps_per_epoch(
        config("ddp", 2, 1), NUM_SAMPLES
    )

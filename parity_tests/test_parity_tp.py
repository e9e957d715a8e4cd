"""jaxdp's tensor parallelism against torch's (issue 49, item 3): ``stack`` with its
Megatron plan over a model axis, trained by jaxdp on a (data 2, model 2) mesh
(``ParityConfig(tp=2)``: ``Parallel(model_axes=("model",))``), equals torch_ref's TP x
DDP (stage 0) and TP x FSDP2 (stages 2 and 3, FSDP2's update; stage 3 FSDP x TP, its
stack gathered a layer at a time on each device's model shards) on a ``(dp 2, tp 2)``
mesh of 4 gloo ranks, and jaxdp's HSDP x TP (``shards=2`` on (data 4, model 2)) equals
FSDP2's HSDP on ``(replicate 2, shard 2, tp 2)``, 8 ranks, after every optimizer step,
AdamW with decay and a clip that acts, float64. The torch runs are test_torch_ref_tp.py's
(shared, made once in the run's batch)."""

from __future__ import annotations

import dataclasses

import pytest
from test_parity_fsdp import assert_trains_as, jaxdp_run, parity_config
from test_torch_ref_tp import HSDP, TP, K
from test_torch_ref_tp import torch_jobs as torch_jobs  # the batch's runs, shared

from jaxdp.parity import torch_config

# (jaxdp's stage, its path, its model axis, torch's strategy), at K = 3 on the 2 data
# ranks: stage 0 is DDP's arithmetic, against TP x DDP; stages 2 and 3 FSDP2's, against
# TP x FSDP2; "hsdp" on 4 data ranks in shard groups of 2, against FSDP2's HSDP x TP.
CELLS = [
    (0, "fused", TP, "tp_ddp"),
    (2, "multisteps", TP, "tp_fsdp"),
    (3, "fused", TP, "tp_fsdp"),
    ("hsdp", "multisteps", TP, "tp_hsdp"),
]


@pytest.fixture(scope="module")
def runs(torch_batch):
    return torch_batch[torch_jobs.__module__]


@pytest.mark.parametrize(("stage", "path", "tp", "strategy"), CELLS, ids=lambda v: str(v))
def test_stack_trains_as_torch_tensor_parallel(runs, stage, path, tp, strategy):
    hsdp = stage == "hsdp"
    config = parity_config(4 if hsdp else 2, K, path, 3 if hsdp else stage, 2 if hsdp else None)
    config = dataclasses.replace(config, tp=tp)
    key = HSDP if hsdp else (strategy, 2 * TP, K)
    torch_run, data, initial = torch_jobs()[key]
    # The torch run is this config's run on tp ranks of each data rank.
    assert torch_config(config) == torch_run
    assert_trains_as(config, jaxdp_run(config, data, initial), runs[key], key)

"""jaxdp against torch's tensor parallelism (issue 49, item 3, the JAX side so far):
``stack`` trained by jaxdp on the 2 data ranks' batch (2 devices, stage 0 and stage 3)
equals torch_ref's TP x DDP and TP x FSDP2 on a ``(dp 2, tp 2)`` mesh of 4 gloo ranks,
after every optimizer step, AdamW with decay and a clip that acts, float64.

jaxdp has no model axis yet (a tensor-parallel annotation on its mesh is refused,
tests/core/test_model_axes.py), so its side here is data-parallel: tensor parallelism
changes where torch's products run, not the update, and this holds jaxdp to the torch
runs its own tensor parallelism will be compared with. The torch runs are
test_torch_ref_tp.py's (shared, made once in the run's batch)."""

from __future__ import annotations

import pytest
from test_parity_fsdp import assert_trains_as, jaxdp_run, parity_config
from test_torch_ref_tp import TP, K
from test_torch_ref_tp import torch_jobs as torch_jobs  # the batch's runs, shared

from jaxdp.parity import torch_config

# (jaxdp's stage, its path, torch's strategy), at K = 3 on the 2 data ranks: stage 0 is
# DDP's arithmetic, against TP x DDP; stage 3 is FSDP2's, against TP x FSDP2.
CELLS = [(0, "fused", "tp_ddp"), (3, "multisteps", "tp_fsdp")]


@pytest.fixture(scope="module")
def runs(torch_batch):
    return torch_batch[torch_jobs.__module__]


@pytest.mark.parametrize(("stage", "path", "strategy"), CELLS, ids=lambda v: str(v))
def test_stack_trains_as_torch_tensor_parallel(runs, stage, path, strategy):
    config = parity_config(2, K, path, stage)
    key = (strategy, 2 * TP, K)
    torch_run, data, initial = torch_jobs()[key]
    # The torch run is this config's run on tp ranks of each data rank.
    assert torch_config(config, num_devices=2 * TP, tp=TP) == torch_run
    assert_trains_as(config, jaxdp_run(config, data, initial), runs[key], key)

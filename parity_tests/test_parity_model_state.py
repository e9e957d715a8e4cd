"""Real-model semantics against torch_ref: BatchNorm in both modes, frozen and unused
parameters (cells.BATCH_NORM, cells.UNUSED)."""

import numpy as np
import pytest
from cells import BATCH_NORM, UNUSED, cell_id
from test_parity_matrix import assert_parity

import jaxdp
from jaxdp.parity import compare, run_jaxdp


@pytest.mark.parametrize("config", BATCH_NORM, ids=cell_id)
def test_batch_norm_weights_and_running_statistics_match(config, torch_runs):
    report = assert_parity(config, torch_runs)
    assert {"bn1.running_mean", "bn2.running_var", "bn2.num_batches_tracked"} <= set(
        report.max_abs[0]
    )


def test_local_and_sync_statistics_train_differently(torch_runs):
    local, sync = (torch_runs[cell_id(c)][2] for c in (BATCH_NORM[0], BATCH_NORM[3]))
    assert BATCH_NORM[3].sync_batchnorm and not BATCH_NORM[0].sync_batchnorm
    for name in ("bn1.running_var", "conv1.weight"):
        assert np.abs(local.states[0][name] - sync.states[0][name]).max() > 1e-6
    # Each rank counts its own forwards in both modes: accum_steps per step.
    assert int(local.states[-1]["bn1.num_batches_tracked"]) == BATCH_NORM[0].steps


@pytest.mark.parametrize("config", UNUSED, ids=cell_id)
def test_frozen_embedding_and_unused_branch_match(config, torch_runs):
    assert_parity(config, torch_runs)
    _, initial, theirs = torch_runs[cell_id(config)]
    np.testing.assert_array_equal(theirs.states[-1]["embed.weight"], initial["embed.weight"])
    # The branch stands still exactly in the steps no micro-batch uses it.
    moved = [
        not np.array_equal(before["branch.weight"], after["branch.weight"])
        for before, after in zip([initial, *theirs.states[:-1]], theirs.states, strict=True)
    ]
    assert moved == [True, True, False] * 3 + [True]


def test_without_skip_unused_momentum_moves_the_unused_branch(torch_runs):
    """The difference skip_unused removes: optax steps a zero-gradient leaf by momentum."""
    config = UNUSED[0]
    data, initial, theirs = torch_runs[cell_id(config)]
    report = compare(
        config, run_jaxdp(config, data, initial, skips=jaxdp.Skips(unused=False)), theirs
    )
    assert report.first_failure == 3, jaxdp.parity.format_parity(report)

"""jaxdp == torch_ref (PyTorch DDP + GA) after every optimizer step, over the matrix in cells.py."""

import numpy as np
import pytest
from cells import FLOAT32, FLOAT64, LAST_WINDOW, LAYOUTS, MODELS, OPTIMIZERS, cell_id

import jaxdp
import torch_ref
from jaxdp.parity import compare, format_parity, run_jaxdp, torch_config


def assert_parity(config, torch_runs):
    data, initial, theirs = torch_runs[cell_id(config)]
    assert len(theirs.states) == config.steps, "torch_ref made a different number of steps"
    report = compare(config, run_jaxdp(config, data, initial), theirs)
    assert report.passed, format_parity(report)
    return report


@pytest.mark.parametrize("config", FLOAT64, ids=cell_id)
def test_float64_weights_and_losses_match_every_step(config, torch_runs):
    assert_parity(config, torch_runs)


def test_the_matrix_meets_every_kind_of_cell():
    """What the float64 and float32 cells cover once the N x K-only cells went (issue 31),
    so that a later edit cannot drop a kind of cell unseen."""
    paths, strategies = {"fused", "multisteps"}, {"pmap", "shard_map"}

    def seen(*fields):
        return {tuple(getattr(c, f) for f in fields) for c in FLOAT64}

    assert seen("model", "optimizer") == {(m, o) for m in MODELS for o in OPTIMIZERS}
    for kind in ("model", "optimizer"):
        values = MODELS if kind == "model" else OPTIMIZERS
        assert seen(kind, "path") == {(v, p) for v in values for p in paths}
        assert seen(kind, "strategy") == {(v, s) for v in values for s in strategies}
    layouts = {((c.num_devices, c.accum_steps), c.path) for c in FLOAT64}
    assert layouts == {(lay, p) for lay in LAYOUTS for p in paths}
    several = [c for c in FLOAT64 if c.num_devices > 1 and c.accum_steps > 1]
    assert {c.strategy for c in several if c.path == "multisteps"} == strategies
    # float32: every model, optimizer, path and strategy; cnn and transformer on both paths.
    assert {c.model for c in FLOAT32} == set(MODELS)
    assert {c.optimizer for c in FLOAT32} == set(OPTIMIZERS)
    assert {(c.path, c.strategy) for c in FLOAT32} == {(p, s) for p in paths for s in strategies}
    assert {(c.model, c.path) for c in FLOAT32} >= {
        (m, p) for m in ("cnn", "transformer") for p in paths
    }


@pytest.mark.parametrize("config", FLOAT32, ids=cell_id)
def test_float32_within_pytorch_assert_equal_defaults(config, torch_runs):
    assert_parity(config, torch_runs)


@pytest.mark.parametrize("config", LAST_WINDOW, ids=cell_id)
def test_last_incomplete_window_policy_matches_torch_ref_loop(config, torch_runs):
    # 10 steps cross two epoch ends, where the policies part ways.
    per_epoch = len(jaxdp.epoch_schedule(config.num_samples, sizes(config), **policy(config)).rows)
    assert per_epoch == (4 if config.last_window == "step" else 3)
    assert torch_ref.steps_per_epoch(torch_config(config), config.num_samples) == per_epoch
    assert_parity(config, torch_runs)


def test_last_window_policies_train_differently(torch_runs):
    drop, step = (torch_runs[cell_id(c)][2] for c in LAST_WINDOW[:2])
    np.testing.assert_array_equal(drop.states[2]["fc1.weight"], step.states[2]["fc1.weight"])
    assert not np.array_equal(drop.states[3]["fc1.weight"], step.states[3]["fc1.weight"])


def sizes(config):
    return jaxdp.batch_sizes(
        num_devices=config.num_devices,
        accum_steps=config.accum_steps,
        micro_batch_size=config.micro_batch_size,
    )


def policy(config):
    return {"last_window": config.last_window}

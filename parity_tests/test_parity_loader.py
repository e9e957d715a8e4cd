"""jaxdp fed by jaxdp.data.Loader == torch_ref: the loader's rows are DistributedSampler's."""

import pytest
from cells import FLOAT64, LAST_WINDOW, cell_id

import jaxdp.data
from jaxdp.parity import Trajectory, _runner, compare, format_parity, run_jaxdp

# The fused path over an epoch end with a padded last window (last_window="step"), and
# multisteps on pmap with 2 devices x 3 micro-batches.
CELLS = [
    LAST_WINDOW[1],
    next(c for c in FLOAT64 if (c.model, c.path, c.strategy) == ("mlp", "multisteps", "pmap")),
]


def train_through_loader(config, step, state, data, permutation, snapshot):
    """run_jaxdp's loop with the batches from a Loader instead of indexing by hand."""
    loader = jaxdp.data.Loader(
        data,
        _runner.sizes_of(config),
        mesh=step.mesh,
        path=config.path,
        shuffle=config.shuffle,
        seed=config.seed,
        permutation=permutation,
        last_window=config.last_window,
        workers=2,
    )
    states, losses = [], []
    for batch in loader:
        state, metrics = step(state, batch.data, batch.micro_weights)
        if batch.emits:
            states.append(snapshot(step.model(state)))
            losses.append(float(metrics["loss"]))
            if len(states) == config.steps:
                break
    return Trajectory(states, losses)


@pytest.mark.parametrize("config", CELLS, ids=cell_id)
def test_loader_fed_training_matches_torch_ref_every_step(config, torch_runs, monkeypatch):
    data, initial, theirs = torch_runs[cell_id(config)]
    monkeypatch.setattr(_runner, "train_steps", train_through_loader)
    ours = run_jaxdp(config, data, initial)
    assert len(ours.states) == config.steps == len(theirs.states)
    report = compare(config, ours, theirs)  # float64 at the matrix's tolerance
    assert report.passed, format_parity(report)

"""Checkpoints written before issue 31 reshaped the step (format 3 at commit 4db92fb:
tests/data/format3/, made by tests/data/make_format3_checkpoints.py, each with its saved
leaves in ``leaves.npz``) restore leaf for leaf and continue bitwise as the saved state
does: multisteps mid-window at ZeRO stages 0 and 2, fused at stage 1.

The continuation is compared with the saved leaves continued in this process, never with
values recorded on another machine: which CPU ran the test does not matter."""

import pathlib
import shutil
import sys

import jax
import numpy as np
import pytest

import jaxdp

DATA = pathlib.Path(__file__).parent / "data"
sys.path.insert(0, str(DATA))
from format2_cases import SIZES, batches, mlp, mse, optimizer  # noqa: E402
from make_format3_checkpoints import CASES  # noqa: E402

# The state's leaves that moved in memory since the fixtures were written (the saved
# names did not change): the skip counters are one record, TrainState.skips.
MOVED = {".skips.skipped_steps": ".skipped_steps", ".skips.consecutive_skips": ".consecutive_skips"}


def saved_name(path):
    name = jax.tree_util.keystr(path)
    return MOVED.get(name, name)


def make_step(case):
    return jaxdp.make_train_step(
        mse,
        optimizer("inject"),
        mesh=jaxdp.data_mesh(SIZES.num_devices),
        accum_steps=SIZES.accum_steps,
        path=case["path"],
        parallel=jaxdp.Parallel(zero_stage=case["zero_stage"]),
    )


def run_on(step, state, micro):
    """The rest of the saved run's window, then one more optimizer step."""
    data = batches(3)
    parts = jaxdp.micro_batches(data[1], SIZES)[micro:] if micro else [data[1]]
    parts += [data[2]] if step.path == "fused" else jaxdp.micro_batches(data[2], SIZES)
    for part in parts:
        state, metrics = step(state, part)
    return state, metrics


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_checkpoint_of_format_3_restores_and_continues_bitwise(name, tmp_path):
    shutil.copytree(DATA / "format3" / name, tmp_path / name)  # restore may rename files
    step = make_step(CASES[name])
    restored = jaxdp.checkpoint.Checkpoints(tmp_path / name).restore(step.init(mlp()), sizes=SIZES)
    state, micro = restored.state, restored.position.micro_batch
    saved = dict(np.load(DATA / "format3" / name / "leaves.npz"))
    leaves = jax.tree_util.tree_leaves_with_path(state)
    assert sorted(saved_name(p) for p, _ in leaves) == sorted(saved)
    for path, leaf in leaves:
        np.testing.assert_array_equal(np.asarray(leaf), saved[saved_name(path)])
    if step.path == "multisteps":
        assert micro == 1 and int(state.window.position) == 1
    # The saved leaves, placed as the restored ones lie, continued by a second step.
    by_hand = jax.tree.map(
        lambda leaf, x: jax.device_put(x, leaf.sharding),
        state,
        jax.tree.unflatten(jax.tree.structure(state), [saved[saved_name(p)] for p, _ in leaves]),
    )
    ours, metrics = run_on(step, state, micro)
    theirs, expected = run_on(make_step(CASES[name]), by_hand, micro)
    assert int(ours.step) == 3
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(metrics["loss"]) == float(expected["loss"])

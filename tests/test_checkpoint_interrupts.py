"""A Ctrl-C during a checkpoint's write or read is an interrupt, never a corrupt checkpoint
(issue 44, item 3: two Ctrl-Cs during a stage-3 save printed "does not read back intact" for
a checkpoint that was intact)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from orbax.checkpoint._src.serialization import serialization

import jaxdp
from jaxdp.checkpoint import Checkpoints


def loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


@pytest.fixture
def trained():
    """A stage-3 state after one step (its leaves split over 4 devices), and its step."""
    step = jaxdp.make_train_step(
        loss, optax.adamw(0.1), mesh=jaxdp.data_mesh(4), parallel=jaxdp.Parallel(zero_stage=3)
    )
    rng = np.random.default_rng(0)
    state = step.init({"w": rng.normal(size=(8, 4)), "b": np.zeros(4)})
    state, _ = step(state, (rng.normal(size=(8, 8)), rng.normal(size=(8, 4))))
    return step, state


def interrupt_reads(monkeypatch, count):
    """The next ``count`` array reads of orbax raise KeyboardInterrupt, as a Ctrl-C that
    lands in one does (orbax re-raises it as an ``Exception`` from it)."""
    read, left = serialization._read_shard, [count]

    async def interrupted(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            raise KeyboardInterrupt
        return await read(*args, **kwargs)

    monkeypatch.setattr(serialization, "_read_shard", interrupted)


def test_an_interrupted_verification_says_so_and_the_checkpoint_restores(
    tmp_path, trained, monkeypatch
):
    _, state = trained
    checkpoints = Checkpoints(tmp_path)
    interrupt_reads(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt, match="reading it back to verify was interrupted"):
        checkpoints.save(state)
    monkeypatch.undo()
    restored = Checkpoints(tmp_path).restore(state)  # verified as it is read: intact
    assert restored.path == tmp_path / "1"
    for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state), strict=True):
        assert np.array_equal(a, b)


def test_an_interrupted_restore_sets_nothing_aside(tmp_path, trained, monkeypatch):
    _, state = trained
    Checkpoints(tmp_path).save(state)
    interrupt_reads(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt, match=f"reading checkpoint {tmp_path / '1'} was int"):
        Checkpoints(tmp_path).restore(state)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # not 1.corrupt
    assert Checkpoints(tmp_path).restore(state).path == tmp_path / "1"

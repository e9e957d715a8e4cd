"""Checkpoints for a team with its own data pipeline (issue 34, item 5): ``save(state)`` and
``restore(like)`` with nothing else, the team's own JSON record of its data position
(``data={...}``) handed back, and training continued bitwise from it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
import jaxdp.data
from jaxdp.checkpoint import CheckpointError, Checkpoints

ROWS, BATCH = 96, 16  # 6 steps an epoch of the team's own pipeline


def make_step(path="fused"):
    return jaxdp.make_train_step(
        lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optax.adamw(1e-2),
        mesh=jaxdp.data_mesh(2),
        accum_steps=2,
        path=path,
    )


def pipeline(offset):
    """The team's own: consecutive rows from ``offset``, a batch at a time."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 3))
    y = x @ np.array([[1.0], [-2.0], [0.5]])
    while True:
        rows = np.arange(offset, offset + BATCH) % ROWS
        yield {"x": x[rows], "y": y[rows]}
        offset += BATCH


def init(step):
    return step.init({"w": jnp.zeros((3, 1))})


def test_save_and_restore_without_a_loader_hands_back_the_data_record_and_continues_bitwise(
    tmp_path,
):
    step = make_step()
    state, batches = init(step), pipeline(0)
    for _ in range(3):
        state, _ = step(state, next(batches))
    Checkpoints(tmp_path).save(state, data={"epoch": 0, "offset": 3 * BATCH, "files": ["a"]})
    for _ in range(2):
        state, _ = step(state, next(batches))

    checkpoints = Checkpoints(tmp_path)
    assert checkpoints.metadata().data == {"epoch": 0, "offset": 48, "files": ["a"]}
    restored = checkpoints.restore(init(step))
    assert restored.data == {"epoch": 0, "offset": 48, "files": ["a"]}
    assert (restored.position, restored.sizes, restored.samples) == (None, None, None)
    again, batches = restored.state, pipeline(restored.data["offset"])
    for _ in range(2):
        again, _ = step(again, next(batches))
    assert int(again.step) == int(state.step) == 5
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise: the same updates on the same rows


def test_a_state_alone_saves_and_a_loader_cannot_restore_a_position_it_lacks(tmp_path):
    step = make_step()
    state, _ = step(init(step), next(pipeline(0)))
    Checkpoints(tmp_path).save(state)
    restored = Checkpoints(tmp_path).restore(init(step))
    assert restored.data is None and int(restored.state.step) == 1
    sizes = jaxdp.batch_sizes(num_devices=2, accum_steps=2, micro_batch_size=4)
    loader = jaxdp.data.Loader(np.zeros((ROWS, 3)), sizes, mesh=jaxdp.data_mesh(2))
    with pytest.raises(
        CheckpointError, match=r"saved without a data position .* restore it without data="
    ):
        Checkpoints(tmp_path).restore(init(step), data=loader)
    with pytest.raises(ValueError, match=r"comes back as Restored.data"):
        Checkpoints(tmp_path).restore(init(step), data={"offset": 16})


def test_a_state_mid_window_needs_the_batch_identity(tmp_path):
    step = make_step("multisteps")
    half = {k: v[: BATCH // 2] for k, v in next(pipeline(0)).items()}
    state, _ = step(init(step), half)
    with pytest.raises(ValueError, match=r"the state is 1 micro-batches into its accumulation"):
        Checkpoints(tmp_path).save(state, data={"offset": 8})
    assert Checkpoints(tmp_path).steps == []


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"offset": np.int64(3)}, r"data=\{'offset': np.int64\(3\)\} must be JSON .*int64"),
        ({"offset": float("nan")}, r"data=\{'offset': nan\} must be JSON \(.*finite float"),
        ({3: "epoch"}, r"data= keys must be strings \(JSON object keys\); 3 is a int"),
    ],
)
def test_data_that_json_cannot_hold_is_refused_before_writing(tmp_path, data, message):
    step = make_step()
    with pytest.raises(ValueError, match=message):
        Checkpoints(tmp_path).save(init(step), data=data)
    assert Checkpoints(tmp_path).steps == []


def test_position_sizes_and_samples_go_together_and_a_saved_batch_is_checked(tmp_path):
    step = make_step()
    with pytest.raises(ValueError, match=r"give sizes=, samples= too, or none of position="):
        Checkpoints(tmp_path).save(init(step), position=jaxdp.SamplerPosition(0, 0))
    sizes = jaxdp.batch_sizes(num_devices=2, accum_steps=2, micro_batch_size=4)
    Checkpoints(tmp_path).save(
        init(step), position=jaxdp.SamplerPosition(0, 0), sizes=sizes, samples=0
    )
    with pytest.raises(CheckpointError, match=r"saved with global_batch_size=16 .* give sizes="):
        Checkpoints(tmp_path).restore(init(step))

"""Checkpoints and exact resume of `jaxdp train` (in-process, short runs)."""

import dataclasses
import json
import pathlib
import shutil

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxdp
from jaxdp.cli._train import TrainConfig, build, make_step, train
from jaxdp.testing import TOLERANCES, assert_trees_close

pytestmark = [
    # The module's runs share fixtures: one worker runs them all, each run once.
    pytest.mark.xdist_group("checkpoint"),
    # After a failed orbax read, tensorstore completes the other reads on a
    # closed event loop. jaxdp silences that in the process hook, but pytest
    # swaps the hook per test, so a late one can reach pytest's.
    pytest.mark.filterwarnings(
        "ignore:(?s).*Event loop is closed:pytest.PytestUnraisableExceptionWarning"
    ),
]

# 1438 training rows, global batch 128: 11 optimizer steps per epoch.
BASE = TrainConfig(num_devices=4, accum_steps=2, micro_batch_size=16, progress=False)


def run(tmp_path, name, stop=None, **changes):
    """Trains with BASE + changes, checkpoints and metrics under tmp_path/name."""
    config = dataclasses.replace(
        BASE,
        checkpoint_dir=str(tmp_path / name),
        metrics_out=str(tmp_path / f"{name}.jsonl"),
        **changes,
    )
    return train(config, stop=stop), config


def saved_arrays(config, step=None):
    """A checkpoint's arrays as numpy, read with orbax alone (the newest by default)."""
    directory = pathlib.Path(config.checkpoint_dir)
    step = step or max(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    arrays = {}
    for item in ("replicated", "per_device"):
        path = directory / str(step) / item
        if path.exists():
            reader = ocp.PyTreeCheckpointer()
            tree = reader.metadata(path).item_metadata.tree
            args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            arrays[item] = reader.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    return arrays


def saved_meta(config, step):
    path = pathlib.Path(config.checkpoint_dir) / str(step) / "meta" / "metadata"
    return json.loads(path.read_text())


def records(config):
    """Metrics without the wall-clock throughput."""
    lines = pathlib.Path(config.metrics_out).read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "samples_per_s"} for line in lines]


def assert_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    leaves = zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True)
    for (path, x), y in leaves:
        assert x.dtype == y.dtype and np.array_equal(x, y), jax.tree_util.keystr(path)


def stop_at(epoch, step, micro=0):
    return lambda position: position == jaxdp.SamplerPosition(epoch, step, micro)


def copy_of(config, tmp_path, **changes):
    """A fixture's checkpoints and metrics, copied so that a test may change them."""
    shutil.copytree(config.checkpoint_dir, tmp_path / "ckpt")
    shutil.copy(config.metrics_out, tmp_path / "ckpt.jsonl")
    return dataclasses.replace(
        config,
        checkpoint_dir=str(tmp_path / "ckpt"),
        metrics_out=str(tmp_path / "ckpt.jsonl"),
        plot=None,
        **changes,
    )


# Multisteps in float64, 14 steps: uninterrupted (`whole`), and stopped after
# micro-batch 0 of step 13 (`mid_cycle`: epoch 1, batch 1), with boundary
# checkpoints every 5 steps on the way (5, 10; 12 at the stop: 12 updates applied).
MULTISTEPS = dict(path="multisteps", precision="float64", steps=14)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return run(tmp_path_factory.mktemp("whole"), "ckpt", **MULTISTEPS)[1]


@pytest.fixture(scope="module")
def mid_cycle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mid_cycle")
    summary, config = run(tmp, "ckpt", stop=stop_at(1, 1, 1), checkpoint_every=5, **MULTISTEPS)
    assert summary["stopped"] and summary["steps"] == 12
    assert jaxdp.checkpoint.Checkpoints(config.checkpoint_dir).steps == [5, 10, 12]
    return config


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """Fused, 9 steps, checkpoints after steps 3, 6 and 9 (384, 768, 1152 samples)."""
    tmp = tmp_path_factory.mktemp("three")
    _, config = run(tmp, "ckpt", steps=9, checkpoint_every=3, plot=str(tmp / "loss.png"))
    return config


def test_mid_cycle_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path, whole, mid_cycle):
    config = copy_of(mid_cycle, tmp_path, resume=True)
    # The checkpoint is exactly where the run stopped: inside step 13's cycle,
    # numbered by the 12 updates applied; the samples are in its metadata.
    meta = saved_meta(config, 12)
    assert meta["position"] == {"epoch": 1, "step_in_epoch": 1, "micro_batch": 1}
    assert (meta["step"], meta["samples"]) == (12, 12 * 128 + 64)
    arrays = saved_arrays(config, 12)
    assert arrays["replicated"]["window"]["position"] == 1
    assert np.any(arrays["per_device"]["window"]["grads"]["fc1"]["kernel"]["value"] != 0)
    summary = train(config)
    assert summary["steps"] == 14
    assert_bitwise_equal(saved_arrays(config), saved_arrays(whole))
    # The metrics file continues where the checkpoint was taken.
    assert records(config) == records(whole)


def test_a_stop_inside_a_checkpointed_window_saves_nothing_and_resume_redoes_it(
    tmp_path, whole, capsys
):
    # As mid_cycle, with checkpoints every 4 steps: the stop (12 updates applied)
    # meets checkpoint 12, taken at the start of the window it stops in.
    summary, config = run(tmp_path, "ckpt", stop=stop_at(1, 1, 1), checkpoint_every=4, **MULTISTEPS)
    directory = pathlib.Path(config.checkpoint_dir)
    assert summary["stopped"] and summary["checkpoint"] == str(directory / "12")
    out = " ".join(capsys.readouterr().out.split())
    assert (
        f"no checkpoint at this stop (next: epoch 1 batch 1 micro-batch 1): {directory / '12'} "
        "holds step 12 already, taken at the start of this accumulation window; a resume "
        "from it redoes the 1 micro-batch(es) since, exactly"
    ) in out
    checkpoints = jaxdp.checkpoint.Checkpoints(directory)
    assert checkpoints.steps == [4, 8, 12]
    assert checkpoints.metadata().position == jaxdp.SamplerPosition(1, 1, 0)
    resumed = train(dataclasses.replace(config, resume=True))
    assert resumed["steps"] == 14
    assert_bitwise_equal(saved_arrays(config), saved_arrays(whole))
    assert records(config) == records(whole)


def test_checkpoints_are_numbered_by_optimizer_step_and_never_overwritten(tmp_path, three):
    config = copy_of(three, tmp_path)
    checkpoints = jaxdp.checkpoint.Checkpoints(config.checkpoint_dir)
    assert checkpoints.steps == [3, 6, 9]
    meta = checkpoints.metadata()  # the newest, without its arrays
    assert (meta.step, meta.samples, meta.path.name) == (9, 9 * 128, "9")
    assert meta.position == jaxdp.SamplerPosition(0, 9, 0)
    assert meta.extra["config"]["steps"] == 9
    step, sizes = make_step(config)
    restored = checkpoints.restore(step.init(build(config)), sizes=sizes)
    assert (restored.samples, restored.path) == (9 * 128, meta.path)
    where = dict(position=restored.position, sizes=sizes, samples=restored.samples)
    with pytest.raises(
        jaxdp.checkpoint.CheckpointError, match=r"/9 exists already: step=9 is taken"
    ):
        checkpoints.save(restored.state, **where)
    older = restored.state._replace(step=restored.state.step - 4)
    with pytest.raises(
        jaxdp.checkpoint.CheckpointError, match=r"step=5 must exceed the newest checkpoint's step 9"
    ):
        checkpoints.save(older, **where)
    assert checkpoints.steps == [3, 6, 9]


def test_fused_mid_epoch_resume_is_bitwise_identical(tmp_path, three):
    _, part = run(tmp_path, "part", stop=stop_at(0, 4), steps=9)
    resumed, _ = run(tmp_path, "part", steps=9, resume=True)
    assert resumed["steps"] == 9
    assert_bitwise_equal(saved_arrays(part), saved_arrays(three))
    assert records(part) == records(three)


def test_every_split_of_a_global_batch_takes_the_same_rows():
    # Step s of an epoch takes rows [s * G, (s + 1) * G) of the sampler's order,
    # whichever num_devices * accum_steps * micro_batch_size makes G = 128.
    order = jaxdp.DistributedSampler(1438, num_replicas=1, rank=0, seed=5).epoch_order()
    for n, k, b in [(4, 2, 16), (2, 4, 16), (8, 1, 16), (1, 8, 16), (4, 1, 32), (8, 4, 4)]:
        sizes = jaxdp.batch_sizes(num_devices=n, accum_steps=k, micro_batch_size=b)
        rows = jaxdp.epoch_schedule(1438, sizes, seed=5).rows
        assert rows.shape == (11, 128)
        for s, step_rows in enumerate(rows):
            assert sorted(step_rows) == sorted(order[s * 128 : (s + 1) * 128])


def test_resume_on_other_devices_at_the_same_global_batch(tmp_path, whole, mid_cycle):
    config = copy_of(mid_cycle, tmp_path, resume=True, num_devices=2, accum_steps=4)
    # From the boundary checkpoint after step 10 (the mid-cycle one cannot be re-split).
    shutil.move(tmp_path / "ckpt" / "12", tmp_path / "mid-cycle")
    summary = train(config)
    assert summary["steps"] == 14
    assert saved_meta(config, 14)["batch"]["num_devices"] == 2
    # The same rows per step; only the summation order differs (devices and
    # micro-batches group the rows differently), so float64 rounding, not bits.
    resumed, uninterrupted = saved_arrays(config), saved_arrays(whole)
    assert_trees_close(
        resumed["replicated"]["params"],
        uninterrupted["replicated"]["params"],
        rtol=TOLERANCES["float64"].rtol,
        atol=0.0,
    )
    losses = [r["loss"] for r in records(config)]
    np.testing.assert_allclose(
        losses, [r["loss"] for r in records(whole)], rtol=TOLERANCES["float64"].rtol
    )


def test_mid_cycle_checkpoint_cannot_change_the_split(tmp_path, mid_cycle):
    config = copy_of(mid_cycle, tmp_path, num_devices=2, accum_steps=4, resume=True)
    with pytest.raises(
        jaxdp.checkpoint.CheckpointError,
        match=r"middle of an accumulation cycle \(micro-batch 1 of 2\)",
    ):
        train(config)


def test_other_global_batch_is_refused_unless_forced(tmp_path, three):
    config = copy_of(three, tmp_path, accum_steps=1, resume=True, steps=12)
    with pytest.raises(
        jaxdp.checkpoint.CheckpointError,
        match=r"global_batch_size=128 = .*; this run has global_batch_size=64 = .*"
        r"changes the data order",
    ):
        train(config)
    forced = train(dataclasses.replace(config, force_resume=True))
    assert forced["steps"] == 12
    # 9 steps of 128 rows, then 3 of 64: epoch 0 resumes at step 9 * 128 // 64 = 18.
    assert forced["samples"] == 9 * 128 + 3 * 64
    assert records(config)[-1]["epoch"] == 0


def test_other_model_shape_is_refused_naming_the_parameters(tmp_path, three):
    config = copy_of(three, tmp_path, hidden=64, resume=True)
    with pytest.raises(jaxdp.checkpoint.CheckpointError, match="different model") as error:
        train(config)
    message = str(error.value)
    assert "params/fc1/kernel (64, 128) float32 vs (64, 64) float32" in message
    assert "params/fc3/kernel (128, 10) float32 vs (64, 10) float32" in message


def test_other_optimizer_is_refused(tmp_path, three):
    config = copy_of(three, tmp_path, optimizer="sgd", resume=True)
    with pytest.raises(
        jaxdp.checkpoint.CheckpointError, match="trained with optimizer='adamw'; this run"
    ):
        train(config)


def corrupt_data(step_dir):
    data = max((step_dir / "replicated" / "d").iterdir(), key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[:100])  # truncated


def flip_a_byte(step_dir):
    data = max((step_dir / "replicated" / "d").iterdir(), key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def corrupt_meta(step_dir):
    (step_dir / "meta" / "metadata").write_text('{"format": ')


def remove_item(step_dir):
    shutil.rmtree(step_dir / "replicated")


def move_the_position(step_dir):
    """Valid JSON that would resume six batches early: only the meta's SHA-256 tells."""
    meta = step_dir / "meta" / "metadata"
    text = meta.read_text()
    # Both copies: the position and the loader's state (jaxdp train saves with data=).
    assert text.count('"step_in_epoch": 9') == 2, text
    meta.write_text(text.replace('"step_in_epoch": 9', '"step_in_epoch": 3'))


@pytest.mark.parametrize(
    "damage", [corrupt_data, flip_a_byte, corrupt_meta, remove_item, move_the_position]
)
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, three, damage):
    config = copy_of(three, tmp_path)
    directory = pathlib.Path(config.checkpoint_dir)
    damage(directory / "9")
    step, sizes = make_step(config)
    with pytest.warns(
        jaxdp.checkpoint.CorruptCheckpointWarning, match=r"/9 is unreadable .*resumed from"
    ):
        restored = jaxdp.checkpoint.Checkpoints(directory).restore(
            step.init(build(config)), sizes=sizes
        )
    assert restored.samples == 768 and int(restored.state.step) == 6
    # The bad one is kept under another name; the number is free again.
    assert sorted(p.name for p in directory.iterdir()) == ["3", "6", "9.corrupt"]


@pytest.mark.parametrize("inside", [False, True])
def test_a_file_as_checkpoint_directory_is_refused_at_construction(tmp_path, inside):
    file = tmp_path / "file"
    file.write_text("not a directory")
    given = file / "ckpt" if inside else file
    where = f"is inside {file}, which is a file" if inside else "is a file"
    with pytest.raises(
        jaxdp.checkpoint.CheckpointError,
        match=f"directory='{given}' {where}, not a directory: checkpoints are directories",
    ):
        jaxdp.checkpoint.Checkpoints(given)
    assert file.read_text() == "not a directory"


def test_training_redoes_a_corrupt_checkpoint_exactly(tmp_path, three):
    config = copy_of(three, tmp_path, resume=True)
    directory = pathlib.Path(config.checkpoint_dir)
    corrupt_data(directory / "9")
    with pytest.warns(jaxdp.checkpoint.CorruptCheckpointWarning):
        summary = train(config)
    assert summary["steps"] == 9
    # Steps 7-9 again: every leaf has the SHA-256 the lost checkpoint recorded.
    lost = json.loads((directory / "9.corrupt" / "meta" / "metadata").read_text())
    redone = json.loads((directory / "9" / "meta" / "metadata").read_text())
    assert redone["leaves"] == lost["leaves"]


def test_no_readable_checkpoint_is_a_clear_error(tmp_path, three):
    config = copy_of(three, tmp_path, resume=True)
    directory = pathlib.Path(config.checkpoint_dir)
    for name in ("3", "6", "9"):
        corrupt_meta(directory / name)
    with pytest.raises(
        jaxdp.checkpoint.CheckpointError, match=r"no readable checkpoint in .*: 9: .*; 6: .*; 3: "
    ):
        train(config)
    assert sorted(p.name for p in directory.iterdir()) == ["3", "6", "9"]


def test_a_crash_before_the_commit_leaves_no_checkpoint_and_resume_redoes_it(
    tmp_path, three, monkeypatch
):
    """Everything written, then the process dies before orbax renames the temporary
    directory: no checkpoint 12 appears, the older ones stay, and resuming redoes it."""
    from orbax.checkpoint._src.path import atomicity

    config = copy_of(three, tmp_path, resume=True, steps=12)
    directory = pathlib.Path(config.checkpoint_dir)

    async def crash(self):
        raise KeyboardInterrupt("killed before the rename")

    with monkeypatch.context() as patch:
        patch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", crash)
        with pytest.raises(KeyboardInterrupt):
            train(config)
    (leftover,) = [p.name for p in directory.iterdir() if not p.name.isdigit()]
    assert leftover.startswith("12.") and "tmp" in leftover
    assert sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) == [3, 6, 9]
    summary = train(config)
    assert summary["steps"] == 12 and summary["checkpoint"] == str(directory / "12")
    assert jaxdp.checkpoint.Checkpoints(directory).steps == [6, 9, 12]
    # The next save (of step 12, with no save running) removed the crashed one's leftover.
    assert sorted(p.name for p in directory.iterdir()) == ["12", "6", "9"]


def test_keep_last_k(tmp_path, three):
    config = copy_of(three, tmp_path, resume=True, steps=15, checkpoint_every=3, keep=2)
    train(config)
    # Each save (read back) deletes all but the two newest: 3 and 6, then 9.
    assert jaxdp.checkpoint.Checkpoints(config.checkpoint_dir).steps == [12, 15]


def test_nothing_is_deleted_for_a_checkpoint_that_does_not_read_back(tmp_path, three, monkeypatch):
    config = copy_of(three, tmp_path)
    step, sizes = make_step(config)
    ckpts = jaxdp.checkpoint.Checkpoints(config.checkpoint_dir, keep=1)
    restored = ckpts.restore(step.init(build(config)), sizes=sizes)
    monkeypatch.setattr(jaxdp.checkpoint.Checkpoints, "_read", lambda *args, **kwargs: 1 / 0)
    state = restored.state._replace(step=restored.state.step + 1)
    with pytest.raises(jaxdp.checkpoint.CheckpointError, match="/10 does not read back intact"):
        ckpts.save(state, position=restored.position, sizes=sizes, samples=restored.samples)
    assert ckpts.steps == [3, 6, 9, 10]


def test_existing_checkpoints_need_resume(tmp_path, three):
    config = copy_of(three, tmp_path)
    with pytest.raises(
        jaxdp.checkpoint.CheckpointError, match=r"already holds checkpoints \[3, 6, 9\]"
    ):
        train(config)


def test_loss_plot_is_a_png(three):
    png = pathlib.Path(three.plot)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(png).shape == (600, 700, 4)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(resume=True), "resume=True needs a checkpoint_dir"),
        (dict(checkpoint_every=5), "checkpoint_every=5 needs a checkpoint_dir"),
        (dict(plot="loss.jpg"), "plot='loss.jpg' must name a .png file"),
        (dict(keep=0), "keep=0 must be a positive integer"),
        (dict(precision="float16"), "precision='float16' must be one of"),
    ],
)
def test_bad_config_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **changes)


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_batch_statistics_rng_streams_and_skip_counts_round_trip(tmp_path, path):
    class Net(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0, dropout=1)
            self.fc = nnx.Linear(4, 8, param_dtype=np.float64, rngs=rngs)
            self.bn = jaxdp.models.BatchNorm(8, param_dtype=np.float64)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.bn(self.fc(x))).sum(axis=1)

    def loss(model, batch):
        return (model(batch) ** 2).mean()

    step = jaxdp.make_train_step(
        loss,
        optax.adam(1e-2),
        mesh=jaxdp.data_mesh(2),
        accum_steps=2,
        path=path,
        batch_stats="local",
        trainable=lambda path, value: path[0] != "fc" or path[1] != "bias",
    )
    sizes = jaxdp.batch_sizes(num_devices=2, accum_steps=2, micro_batch_size=2)
    x = np.random.default_rng(0).normal(size=(8, 4))
    bad = x.copy()
    bad[0, 0] = np.nan
    state = step.init(Net())
    for batch in (x, bad, x):
        calls = [batch] if path == "fused" else jaxdp.micro_batches(batch, sizes)
        for call in calls:
            state, _ = step(state, call)
    checkpoints = jaxdp.checkpoint.Checkpoints(tmp_path / "ckpt")
    checkpoints.save(state, position=jaxdp.SamplerPosition(0, 3), sizes=sizes, samples=24)
    restored = checkpoints.restore(step.init(Net()), sizes=sizes).state
    assert int(restored.skipped_steps) == 1 and int(restored.step) == 2
    keys = [nnx.filter_state(s.model_state, nnx.RngKey) for s in (restored, state)]
    assert_trees_close(*(jax.tree.map(jax.random.key_data, k) for k in keys), rtol=0, atol=0.0)
    stats = [nnx.filter_state(s.model_state, nnx.BatchStat) for s in (restored, state)]
    assert_trees_close(*stats, rtol=0, atol=0.0)
    assert int(restored.model_state["bn"]["num_batches_tracked"][...]) == 4
    assert_trees_close(restored.opt_state, state.opt_state, rtol=0, atol=0.0)

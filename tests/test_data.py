"""jaxdp.data: the loader's rows against epoch_schedule, its placement, its position
through checkpoints, and the bad input it refuses (the two-process read count is in
tests/test_distributed.py)."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import jaxdp
import jaxdp.data

# 4 devices x 3 micro-batches of 2: each rank has ceil(103 / 4) = 26 indices, 13
# micro-batches, 4 whole windows and 1 micro-batch left: last_window="step" adds a step.
SIZES = jaxdp.batch_sizes(num_devices=4, accum_steps=3, micro_batch_size=2)
N = 103


class Counting:
    """A record-at-a-time source that records every index read (from any thread)."""

    def __init__(self, n, fail_at=None, exception=None):
        self.x, self.read, self.fail_at, self.exception = np.arange(n), [], fail_at, exception
        self.lock = threading.Lock()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i == self.fail_at:
            raise self.exception
        with self.lock:
            self.read.append(i)
        return {"x": np.array([float(self.x[i])]), "y": np.int32(self.x[i])}


def expected_calls(sizes, path, epochs, **order):
    """``(rows, micro_weights)`` of every call, from epoch_schedule and micro_batches."""
    calls = []
    for epoch in range(epochs):
        schedule = jaxdp.epoch_schedule(N, sizes, epoch=epoch, **order)
        for rows, weights in zip(schedule.rows, schedule.micro_weights, strict=True):
            if path == "fused":
                calls.append((rows, weights))
            else:
                parts = jaxdp.micro_batches(rows, sizes)
                calls += [(m, w) for m, w in zip(parts, weights, strict=True)]
    return calls


def loader(source=None, sizes=SIZES, **kwargs):
    mesh = jaxdp.data_mesh(sizes.num_devices)
    return jaxdp.data.Loader(np.arange(N) if source is None else source, sizes, mesh=mesh, **kwargs)


@pytest.mark.parametrize("path", ["fused", "multisteps"])
@pytest.mark.parametrize("last_window", ["drop", "step"])
def test_rows_are_epoch_schedules_rows(path, last_window):
    got = list(loader(path=path, last_window=last_window, epochs=2, seed=5))
    want = expected_calls(SIZES, path, 2, last_window=last_window, seed=5)
    assert len(got) == len(want)
    for batch, (rows, weights) in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(batch.data), rows)
        np.testing.assert_array_equal(batch.micro_weights, weights)
    steps, window = [], 0.0
    for b in got:  # the real micro-batches of each optimizer step
        window += float(np.sum(b.micro_weights))
        if b.emits:
            steps, window = [*steps, window], 0.0
    # An epoch has 4 whole steps, and with "step" one of 1 real micro-batch of 3.
    assert steps == ([3.0] * 4 + [1.0] if last_window == "step" else [3.0] * 4) * 2
    emitted = [b.position for b in got if b.emits]
    assert emitted[-1] == jaxdp.SamplerPosition(2, 0, 0)


def test_batches_are_placed_on_the_mesh_split_by_rows():
    source = {"x": np.arange(N * 2.0).reshape(N, 2), "y": np.arange(N)}
    (first,) = [b for _, b in zip(range(1), loader(source), strict=False)]
    mesh = jaxdp.data_mesh(SIZES.num_devices)
    for leaf in jax.tree.leaves(first.data):
        assert isinstance(leaf, jax.Array) and leaf.shape[0] == SIZES.global_batch_size
        assert leaf.sharding.is_equivalent_to(
            NamedSharding(mesh, jax.sharding.PartitionSpec("data")), leaf.ndim
        )
    rows = jaxdp.epoch_schedule(N, SIZES).rows[0]
    np.testing.assert_array_equal(np.asarray(first.data["x"]), source["x"][rows])


def test_record_sources_and_transforms_stack_the_same_rows():
    counting = Counting(N)

    def times_ten(record):
        return {**record, "x": record["x"] * 10}

    transform: jaxdp.data.Transform = times_ten
    got = next(iter(loader(counting, transform=transform)))
    assert isinstance(got, jaxdp.data.Batch) and got.emits
    rows = jaxdp.epoch_schedule(N, SIZES).rows[0]
    np.testing.assert_array_equal(np.asarray(got.data["x"])[:, 0], rows * 10.0)
    np.testing.assert_array_equal(np.asarray(got.data["y"]), rows)


def test_breaking_out_and_iterating_again_continues_with_the_next_call():
    data = loader(path="multisteps", epochs=1)
    first = [b for _, b in zip(range(5), data, strict=False)]
    assert data.position == first[-1].position == jaxdp.SamplerPosition(0, 1, 2)
    rest = list(data)
    want = expected_calls(SIZES, "multisteps", 1)
    got = [np.asarray(b.data) for b in first + rest]
    assert len(got) == len(want)
    for g, (rows, _) in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, rows)


@pytest.mark.parametrize(
    "split", [dict(num_devices=4, accum_steps=3), dict(num_devices=2, accum_steps=6)]
)
def test_state_restores_the_same_rows_on_another_split_of_the_global_batch(split):
    data = loader(epochs=1)
    taken = [b for _, b in zip(range(3), data, strict=False)]
    state = data.state()
    assert state["step_in_epoch"] == 3 and state["samples"] == 3 * SIZES.global_batch_size
    sizes = jaxdp.batch_sizes(global_batch_size=SIZES.global_batch_size, **split)
    again = loader(sizes=sizes, epochs=1)
    assert again.restore(state) == jaxdp.SamplerPosition(0, 3, 0)
    rest = [np.asarray(b.data) for b in again]
    schedule = jaxdp.epoch_schedule(N, sizes).rows
    assert len(taken) + len(rest) == len(schedule)
    for got, rows in zip(rest, schedule[3:], strict=True):
        np.testing.assert_array_equal(got, rows)
        # The same rows as the saved split's step, in another device-major grouping.
    np.testing.assert_array_equal(np.sort(rest[0]), np.sort(jaxdp.epoch_schedule(N, SIZES).rows[3]))


def test_a_restore_from_another_data_set_or_global_batch_is_refused_naming_both():
    state = loader().state()
    with pytest.raises(ValueError, match="saved with dataset_size=103; this loader has dataset_s"):
        loader(np.arange(N + 1)).restore(state)
    with pytest.raises(ValueError, match="saved with seed=0; this loader has seed=1"):
        loader(seed=1).restore(state)
    other = jaxdp.batch_sizes(num_devices=4, accum_steps=1, micro_batch_size=2)
    with pytest.raises(
        ValueError,
        match="global_batch_size=24 = num_devices=4 x accum_steps=3.*"
        "this loader has global_batch_size=8",
    ):
        loader(sizes=other).restore(state)
    forced = loader(sizes=other)
    assert forced.restore({**state, "step_in_epoch": 2}, force=True) == (0, 6, 0)


@pytest.mark.parametrize(
    "source,error,message",
    [
        (
            {"x": np.zeros((10, 2)), "y": np.zeros(9)},
            ValueError,
            r"same number of rows .*source\['x'\] has 10, source\['y'\] has 9",
        ),
        (np.zeros((0, 3)), ValueError, "source is empty"),
        (
            np.zeros(20),
            ValueError,
            "source has 20 rows, too few for one optimizer step of global_batch_size=24",
        ),
        (object(), TypeError, "must be an array, a dict/tuple of arrays, have __len__"),
        (iter(range(100)), TypeError, r"is an iterator \(range_iterator\): it is read once"),
        ({"x": np.zeros(())}, ValueError, r"source\['x'\] has shape \(\)"),
    ],
)
def test_bad_sources_are_refused_at_construction(source, error, message):
    with pytest.raises(error, match=message):
        loader(source)


def test_records_of_different_shapes_are_named():
    ragged = [np.zeros(3)] * N
    ragged[5] = np.zeros(4)
    with pytest.raises(ValueError, match=r"source record 5 has fields and shapes \(4,\)"):
        list(loader(ragged, shuffle=False))


def test_a_transform_that_raises_names_the_record():
    def transform(record):
        if record["y"] == 17:
            raise KeyError("label")
        return record

    with pytest.raises(ValueError, match="transform raised on record 17 of the source: KeyError"):
        list(loader(Counting(N), transform=transform, epochs=1))


def test_a_worker_that_dies_raises_in_the_loop_instead_of_hanging():
    source = Counting(N, fail_at=40, exception=SystemExit("worker gone"))
    data = loader(source, shuffle=False, epochs=1, workers=2)
    seen = []
    with pytest.raises(jaxdp.data.LoaderWorkerError, match="worker died: SystemExit: worker gone"):
        for batch in data:
            seen.append(batch)
    # Step 0 holds records 0 to 23 (shuffle off) and arrived; step 1 holds record 40.
    assert len(seen) == 1 and data.position == seen[-1].position == (0, 1, 0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(path="fast"), "path='fast' must be 'fused' or 'multisteps'"),
        (dict(workers=0), "workers=0 must be a positive integer"),
        (dict(prefetch=1.5), "prefetch=1.5 must be a positive integer"),
        (dict(epochs=0), "epochs=0 must be a positive integer or None"),
        (dict(transform="upper"), "transform='upper' must be callable"),
        # Issue 50, item 9: said "source has 103 rows, too few for one optimizer step".
        (dict(last_window="keep"), r"^last_window='keep' must be 'drop' or 'step'$"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    source = Counting(N)
    with pytest.raises((ValueError, TypeError), match=message):
        loader(source, **kwargs)
    assert source.read == []  # before any record is read


# ---- through the step and checkpoints ---------------------------------------------------


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)


def regression():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 3))
    return {"x": x, "y": x @ np.array([1.0, -2.0, 0.5])}


def make_step(path):
    mesh = jaxdp.data_mesh(SIZES.num_devices)
    return jaxdp.make_train_step(
        loss_fn, optax.adam(0.05), mesh=mesh, accum_steps=SIZES.accum_steps, path=path
    )


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_loader_fed_training_equals_indexing_by_epoch_schedule(path):
    source, step = regression(), make_step(path)
    state = step.init(np.zeros(3))
    for batch in loader(source, path=path, epochs=2, last_window="step"):
        state, _ = step(state, batch.data, batch.micro_weights)
    by_hand = step.init(np.zeros(3))
    for epoch in range(2):
        schedule = jaxdp.epoch_schedule(N, SIZES, epoch=epoch, last_window="step")
        for rows, weights in zip(schedule.rows, schedule.micro_weights, strict=True):
            batch = jax.tree.map(lambda a, rows=rows: a[rows], source)
            calls = [batch] if path == "fused" else jaxdp.micro_batches(batch, SIZES)
            for j, call in enumerate(calls):
                w = weights if path == "fused" else weights[j]
                by_hand, _ = step(by_hand, call, w)
    np.testing.assert_array_equal(np.asarray(state.params), np.asarray(by_hand.params))


def test_checkpoints_save_and_restore_the_loaders_position_mid_window(tmp_path):
    source, step = regression(), make_step("multisteps")
    state, data = step.init(np.zeros(3)), loader(source, path="multisteps", epochs=2)
    for _, batch in zip(range(11), data, strict=False):  # 3 steps and 2 micro-batches
        state, _ = step(state, batch.data, batch.micro_weights)
    checkpoints = jaxdp.checkpoint.Checkpoints(tmp_path)
    checkpoints.save(state, data=data)  # no position by hand
    for batch in data:
        state, _ = step(state, batch.data, batch.micro_weights)

    resumed = loader(source, path="multisteps", epochs=2)
    restored = checkpoints.restore(step.init(np.zeros(3)), data=resumed)
    assert resumed.position == restored.position == jaxdp.SamplerPosition(0, 3, 2)
    assert resumed.samples == 11 * SIZES.num_devices * SIZES.micro_batch_size
    again = restored.state
    for batch in resumed:
        again, _ = step(again, batch.data, batch.micro_weights)
    np.testing.assert_array_equal(np.asarray(again.params), np.asarray(state.params))


def test_checkpoints_refuse_a_loader_over_another_data_set(tmp_path):
    source, step = regression(), make_step("fused")
    state, data = step.init(np.zeros(3)), loader(source, epochs=1)
    batch = next(iter(data))
    state, _ = step(state, batch.data, batch.micro_weights)
    checkpoints = jaxdp.checkpoint.Checkpoints(tmp_path)
    checkpoints.save(state, data=data)
    with pytest.raises(ValueError, match="give data= .* or position= and sizes=, not both"):
        checkpoints.save(state, data=data, position=data.position)
    shorter = loader(jax.tree.map(lambda a: a[:-1], source))
    with pytest.raises(
        jaxdp.checkpoint.CheckpointError,
        match="saved with dataset_size=103; this loader has dataset_size=102",
    ):
        checkpoints.restore(step.init(np.zeros(3)), data=shorter)


def test_evaluate_means_every_row_once_on_any_device_count_without_recompiling():
    """10 rows in batches of 4 devices x 2 rows: 6 padding rows add nothing."""
    traced = []

    def per_row(scale, batch):
        traced.append(1)  # once per trace
        return {"x": batch["x"][:, 0] * scale, "even": batch["y"] % 2 == 0}

    metrics: jaxdp.data.MetricsFn = per_row

    source = {"x": np.arange(10.0, dtype=np.float32)[:, None], "y": np.arange(10)}
    expected = {"x": 2 * 4.5, "even": 0.5}
    for devices in (4, 1, 4):  # the second 4-device call reuses the first's program
        mesh = jaxdp.data_mesh(devices)
        got = jaxdp.data.evaluate(metrics, np.float32(2.0), source, mesh=mesh, batch_size=2)
        assert got == expected
    assert len(traced) == 2
    with pytest.raises(ValueError, match=r"batch_size=0 must be a positive integer"):
        jaxdp.data.evaluate(metrics, 1.0, source, mesh=mesh, batch_size=0)
    with pytest.raises(ValueError, match=r"metrics_fn's 'sum' has shape \(\); a metric needs"):
        jaxdp.data.evaluate(
            lambda p, b: {"sum": b["y"].sum()}, 1.0, source, mesh=mesh, batch_size=2
        )

"""The core's types, aliases and small helpers, each held to what it promises."""

import typing

import numpy as np
import optax
import pytest

import jaxdp


def loss(params, batch):
    return ((batch @ params["w"]) ** 2).mean()


def test_batch_sizes_is_the_identity_as_a_named_tuple():
    sizes = jaxdp.batch_sizes(num_devices=4, accum_steps=2, global_batch_size=24)
    assert sizes == jaxdp.BatchSizes(4, 2, 3, 24)
    assert sizes.describe() == (
        "global_batch_size=24 = num_devices=4 x accum_steps=2 x micro_batch_size=3"
    )


def test_epoch_schedule_returns_rows_and_weights_per_step():
    sizes = jaxdp.batch_sizes(num_devices=2, accum_steps=2, micro_batch_size=2)
    schedule = jaxdp.epoch_schedule(20, sizes, shuffle=False, last_window="step")
    assert isinstance(schedule, jaxdp.EpochSchedule)
    # 10 per rank: 5 micro-batches, two windows of 2 and one micro-batch left.
    assert schedule.rows.shape == (3, 8)
    np.testing.assert_array_equal(schedule.micro_weights, [[1, 1], [1, 1], [1, 0]])


def strategy(value):
    return {"parallel": jaxdp.Parallel(strategy=value)}


@pytest.mark.parametrize(
    "alias,argument,options",
    [
        (jaxdp.AccumulationPath, "path", None),
        (jaxdp.Strategy, "strategy", strategy),
        (jaxdp.LossReduction, "loss_reduction", None),
        (jaxdp.BatchStats, "batch_stats", None),
    ],
)
def test_each_string_alias_lists_what_make_train_step_accepts(alias, argument, options):
    mesh = jaxdp.data_mesh(1)
    options = options or (lambda value: {argument: value})
    for value in typing.get_args(alias):
        jaxdp.make_train_step(loss, optax.sgd(0.1), mesh=mesh, **options(value))
    with pytest.raises(ValueError, match=rf"{argument}='other' must be"):
        jaxdp.make_train_step(loss, optax.sgd(0.1), mesh=mesh, **options("other"))


def test_last_window_lists_what_epoch_schedule_accepts():
    sizes = jaxdp.batch_sizes(num_devices=1, accum_steps=2, micro_batch_size=2)
    for value in typing.get_args(jaxdp.LastWindow):
        jaxdp.epoch_schedule(10, sizes, last_window=value)
    with pytest.raises(ValueError, match="last_window='keep' must be 'drop' or 'step'"):
        jaxdp.epoch_schedule(10, sizes, last_window="keep")


def test_trainable_is_the_type_of_make_train_step_trainable():
    hints = typing.get_type_hints(jaxdp.make_train_step)
    assert hints["trainable"] is jaxdp.Trainable


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_init_gives_a_train_state_and_multisteps_a_window(path):
    step = jaxdp.make_train_step(
        loss, optax.sgd(0.1), mesh=jaxdp.data_mesh(2), accum_steps=2, path=path
    )
    state = step.init({"w": np.ones((3, 1), np.float32)})
    assert isinstance(state, jaxdp.TrainState)
    if path == "fused":
        assert state.window is None
    else:
        assert isinstance(state.window, jaxdp.Window)
        assert state.window.loss_sum.shape == (2,)  # one per device
        assert int(state.window.position) == 0


def test_the_names_of_jaxdp_0_2_warn_and_still_work():
    mesh = jaxdp.data_mesh(2)
    with pytest.warns(
        DeprecationWarning,
        match=r"write parallel=jaxdp\.Parallel\(zero_stage=\.\.\., strategy=\.\.\.\)",
    ):
        old = jaxdp.make_train_step(
            loss, optax.sgd(0.1), mesh=mesh, zero_stage=1, strategy="shard_map"
        )
    assert old.options.parallel == jaxdp.Parallel(zero_stage=1)
    with pytest.warns(
        DeprecationWarning,
        match=r"write skips=jaxdp\.Skips\(max_consecutive=\.\.\., unused=\.\.\.\)",
    ):
        old = jaxdp.make_train_step(
            loss, optax.sgd(0.1), mesh=mesh, max_consecutive_skips=3, skip_unused=True
        )
    assert old.options.skips == jaxdp.Skips(max_consecutive=3, unused=True)
    with pytest.raises(
        TypeError, match="got zero_stage= and parallel=; zero_stage is parallel.zero_stage"
    ):
        jaxdp.make_train_step(
            loss, optax.sgd(0.1), mesh=mesh, zero_stage=1, parallel=jaxdp.Parallel()
        )
    with pytest.raises(TypeError, match="unexpected keyword argument 'zero'"):
        jaxdp.make_train_step(loss, optax.sgd(0.1), mesh=mesh, zero=1)
    with pytest.raises(TypeError, match=r"parallel=1 must be a jaxdp\.Parallel"):
        jaxdp.make_train_step(loss, optax.sgd(0.1), mesh=mesh, parallel=1)
    state = jaxdp.make_train_step(loss, optax.sgd(0.1), mesh=mesh, path="multisteps").init(
        {"w": np.ones((3, 1), np.float32)}
    )
    with pytest.warns(DeprecationWarning, match="TrainState.accum is deprecated"):
        assert state.accum is state.window
    with pytest.warns(DeprecationWarning, match="jaxdp.AccumState is deprecated"):
        assert jaxdp.AccumState is jaxdp.Window


def test_all_reduces_describes_each_as_an_all_reduce():
    step = jaxdp.make_train_step(loss, optax.sgd(0.1), mesh=jaxdp.data_mesh(2), accum_steps=2)
    state = step.init({"w": np.ones((3, 1), np.float32)})
    (reduce,) = jaxdp.testing.all_reduces(step.compile(state, np.ones((8, 3), np.float32)))
    assert isinstance(reduce, jaxdp.testing.AllReduce)
    assert reduce.executions == (1, 1) and not reduce.in_loop


def test_resume_position_keeps_the_step_for_the_same_global_batch():
    saved = jaxdp.batch_sizes(num_devices=4, accum_steps=2, micro_batch_size=4)  # 32
    split = jaxdp.batch_sizes(num_devices=2, accum_steps=4, micro_batch_size=4)  # 32
    half = jaxdp.batch_sizes(num_devices=2, accum_steps=2, micro_batch_size=4)  # 16
    at = jaxdp.SamplerPosition(epoch=1, step_in_epoch=3)
    assert jaxdp.resume_position(at, saved=saved, sizes=split, steps_per_epoch=10) == at
    # Another global batch: the step holding the first unseen row, 3 * 32 // 16.
    moved = jaxdp.resume_position(at, saved=saved, sizes=half, steps_per_epoch=20)
    assert moved == jaxdp.SamplerPosition(1, 6, 0)
    end = jaxdp.SamplerPosition(epoch=1, step_in_epoch=10)
    assert jaxdp.resume_position(end, saved=saved, sizes=saved, steps_per_epoch=10) == (2, 0, 0)


class FakeState(typing.NamedTuple):
    step: int
    consecutive_skips: int


def test_skip_watch_raises_two_calls_behind_and_resets():
    watch = jaxdp.SkipWatch(2, bound=False)
    for skips in (1, 2, 3):  # the counters three calls reported
        watch.before(FakeState(0, skips))
        watch.after({"consecutive_skips": np.int32(skips)})
    # The call two back (skips=2) reached the limit: the given state is read.
    with pytest.raises(jaxdp.NonFiniteError, match="2 optimizer steps in a row") as error:
        watch.before(FakeState(5, 2))
    assert error.value.state == FakeState(5, 2)
    watch.reset()
    watch.before(FakeState(5, 2))  # nothing seen since the reset
    with pytest.raises(ValueError, match="limit=0 must be a positive integer or None"):
        jaxdp.SkipWatch(0, bound=True)

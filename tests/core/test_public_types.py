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


@pytest.mark.parametrize(
    "alias,argument",
    [
        (jaxdp.AccumulationPath, "path"),
        (jaxdp.Strategy, "strategy"),
        (jaxdp.LossReduction, "loss_reduction"),
        (jaxdp.BatchStats, "batch_stats"),
    ],
)
def test_each_string_alias_lists_what_make_train_step_accepts(alias, argument):
    mesh = jaxdp.data_mesh(1)
    for value in typing.get_args(alias):
        jaxdp.make_train_step(loss, optax.sgd(0.1), mesh=mesh, **{argument: value})
    with pytest.raises(ValueError, match=rf"{argument}='other' must be"):
        jaxdp.make_train_step(loss, optax.sgd(0.1), mesh=mesh, **{argument: "other"})


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
def test_init_gives_a_train_state_and_multisteps_an_accum_state(path):
    step = jaxdp.make_train_step(
        loss, optax.sgd(0.1), mesh=jaxdp.data_mesh(2), accum_steps=2, path=path
    )
    state = step.init({"w": np.ones((3, 1), np.float32)})
    assert isinstance(state, jaxdp.TrainState)
    if path == "fused":
        assert state.accum is None
    else:
        assert isinstance(state.accum, jaxdp.AccumState)
        assert state.accum.loss_sum.shape == (2,)  # one per device


def test_all_reduces_describes_each_as_an_all_reduce():
    step = jaxdp.make_train_step(loss, optax.sgd(0.1), mesh=jaxdp.data_mesh(2), accum_steps=2)
    state = step.init({"w": np.ones((3, 1), np.float32)})
    (reduce,) = jaxdp.all_reduces(step.compile(state, np.ones((8, 3), np.float32)))
    assert isinstance(reduce, jaxdp.AllReduce)
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

"""The last, incomplete accumulation window: schedule and weight-0 padding."""

import numpy as np
import pytest
from models import OPTIMIZERS, big_batch_reference, mlp_params, mse_loss, regression_data

import jaxdp
from jaxdp.testing import TOLERANCES, assert_trees_close


def sizes(num_devices=2, accum_steps=3, micro_batch_size=2):
    return jaxdp.batch_sizes(
        num_devices=num_devices, accum_steps=accum_steps, micro_batch_size=micro_batch_size
    )


def test_drop_keeps_only_whole_windows():
    # 22 samples: 11 per rank, 5 whole micro-batches of 2, one window of 3.
    schedule = jaxdp.epoch_schedule(22, sizes(), shuffle=False)
    assert schedule.rows.shape == (1, 12)
    np.testing.assert_array_equal(schedule.micro_weights, [[1, 1, 1]])
    # Device-major: rank 0's three micro-batches of even indices, then rank 1's odd ones.
    np.testing.assert_array_equal(schedule.rows[0], [0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11])


def test_step_pads_the_last_window_with_weight_zero_copies():
    schedule = jaxdp.epoch_schedule(22, sizes(), shuffle=False, last_window="step")
    np.testing.assert_array_equal(schedule.micro_weights, [[1, 1, 1], [1, 1, 0]])
    # Rank 0 takes even indices, rank 1 odd; the padding repeats micro-batch 0.
    np.testing.assert_array_equal(
        schedule.rows[1], [12, 14, 16, 18, 12, 14, 13, 15, 17, 19, 13, 15]
    )


def test_every_whole_micro_batch_is_used_once_with_step():
    schedule = jaxdp.epoch_schedule(
        100, sizes(), seed=3, epoch=1, last_window="step", drop_last=True
    )
    # 50 samples per rank: 25 micro-batches of 2, 8 whole windows of 3 and one of 1.
    assert schedule.rows.shape == (9, 12)
    per_micro = schedule.rows.reshape(9, 2, 3, 2)  # steps, ranks, micro-batches, rows
    real = np.broadcast_to(schedule.micro_weights[:, None, :] > 0, (9, 2, 3))
    used = per_micro[real]
    assert len(np.unique(used)) == used.size == 100


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="last_window='keep' must be 'drop' or 'step'"):
        jaxdp.epoch_schedule(22, sizes(), last_window="keep")


def test_micro_weights_shape_is_checked():
    step = jaxdp.make_train_step(
        mse_loss, OPTIMIZERS["sgd_momentum"](), mesh=jaxdp.data_mesh(2), accum_steps=3
    )
    state = step.init(mlp_params())
    x, y = regression_data(12)
    with pytest.raises(ValueError, match=r"micro_weights has shape \(2,\); the fused path takes"):
        step(state, (x, y), np.ones(2))


@pytest.mark.parametrize("path", ["fused", "multisteps"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_padded_window_equals_a_step_on_its_real_micro_batches(path, optimizer):
    """A window of 3 with one weight-0 micro-batch == a step on the 2 real ones."""
    n, k, b = 2, 3, 4
    s = sizes(n, k, b)
    x, y = regression_data(2 * n * k * b)
    full = (x[: n * k * b], y[: n * k * b])
    last = tuple(a[n * k * b :].reshape(n, k, b, -1) for a in (x, y))
    last = tuple(a.reshape(n * k * b, -1) for a in last)
    weights = np.array([1.0, 1.0, 0.0])
    # The reference sees device r's first two micro-batches of the last window.
    real = tuple(a.reshape(n, k, b, -1)[:, :2].reshape(n * 2 * b, -1) for a in last)
    expected = big_batch_reference(mse_loss, OPTIMIZERS[optimizer](), mlp_params(), [full, real])
    step = jaxdp.make_train_step(
        mse_loss, OPTIMIZERS[optimizer](), mesh=jaxdp.data_mesh(n), accum_steps=k, path=path
    )
    state = step.init(mlp_params())
    for batch, w in ((full, np.ones(k)), (last, weights)):
        if path == "fused":
            state, metrics = step(state, batch, w)
        else:
            for micro, wj in zip(jaxdp.micro_batches(batch, s), w, strict=True):
                state, metrics = step(state, micro, wj)
    assert int(state.step) == 2
    assert_trees_close(state.params, expected, rtol=TOLERANCES["float64"].rtol, atol=0.0)
    # The loss metric is the mean over the real micro-batches only.
    before = big_batch_reference(mse_loss, OPTIMIZERS[optimizer](), mlp_params(), [full])
    np.testing.assert_allclose(float(metrics["loss"]), float(mse_loss(before, real)), rtol=1e-12)

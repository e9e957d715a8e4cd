"""Acceptance 1: (N devices, K micro-batches) == one big batch on one device."""

import jax
import numpy as np
import pytest
from helpers import ATOL, RTOL, assert_trees_close
from models import OPTIMIZERS, big_batch_reference, mlp_params, mse_loss, regression_data, train

import jaxdp

GLOBAL_BATCH = 64  # divisible by every num_devices * accum_steps below
STEPS = 5


@pytest.fixture(scope="module")
def batches():
    x, y = regression_data(GLOBAL_BATCH * STEPS)
    return [(x[i::STEPS], y[i::STEPS]) for i in range(STEPS)]


@pytest.fixture(scope="module")
def reference(batches):
    return {
        name: big_batch_reference(mse_loss, make(), mlp_params(), batches)
        for name, make in OPTIMIZERS.items()
    }


# Every (num_devices, accum_steps, path, strategy) cell, each with one optimizer: the
# two alternate so that each optimizer meets every (N, K) on both paths and both
# strategies (the optimizer sees only the averaged gradient; which one runs in a cell
# does not touch the split, but its state's handling on each path must be checked).
GRID = [
    (n, k, sorted(OPTIMIZERS)[(ni + ki + pi + si) % len(OPTIMIZERS)], path, strategy)
    for ni, n in enumerate([1, 2, 4, 8])
    for ki, k in enumerate([1, 2, 4])
    for pi, path in enumerate(["fused", "multisteps"])
    for si, strategy in enumerate(["shard_map", "pmap"])
]


@pytest.mark.parametrize(
    ("num_devices", "accum_steps", "optimizer", "path", "strategy"),
    GRID,
    ids=["-".join(map(str, cell)) for cell in GRID],
)
def test_data_parallel_accumulation_equals_big_batch(
    batches, reference, num_devices, accum_steps, optimizer, path, strategy
):
    step = jaxdp.make_train_step(
        mse_loss,
        OPTIMIZERS[optimizer](),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        path=path,
        parallel=jaxdp.Parallel(strategy=strategy),
    )
    state, _ = train(step, mlp_params(), batches)
    assert int(state.step) == STEPS
    assert_trees_close(state.params, reference[optimizer], rtol=RTOL["float64"])


@pytest.mark.parametrize("path", ["fused", "multisteps"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("num_devices", "accum_steps"), [(1, 4), (2, 2), (8, 4)])
def test_float32_within_named_tolerance(num_devices, accum_steps, optimizer, path):
    x, y = regression_data(GLOBAL_BATCH * STEPS, dtype=np.float32)
    batches = [(x[i::STEPS], y[i::STEPS]) for i in range(STEPS)]
    params = mlp_params(dtype=np.float32)
    expected = big_batch_reference(mse_loss, OPTIMIZERS[optimizer](), params, batches)
    step = jaxdp.make_train_step(
        mse_loss,
        OPTIMIZERS[optimizer](),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        path=path,
    )
    state, _ = train(step, params, batches)
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(state.params))
    assert_trees_close(state.params, expected, rtol=RTOL["float32"], atol=ATOL["float32"])

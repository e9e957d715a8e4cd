"""Dropout keys: per device and micro-batch, from one seed and the step, whatever the processes."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dropout_run import ACCUM, MICRO, NUM_DEVICES, STEPS, Masked, batches, make_step, train
from flax import nnx
from helpers import reserved_port

import jaxdp


def masks(weights):
    """The (device, micro-batch) dropout masks of each step, from the weight deltas:
    sgd(1.0) moves w[i] by -mask_i / keep / (num_devices * accum_steps)."""
    deltas = np.diff(np.concatenate([np.zeros_like(weights[:1]), weights]), axis=0)
    scaled = -deltas * NUM_DEVICES * ACCUM * 0.5
    assert np.all(np.isin(scaled, [0.0, 1.0])), "each entry is a kept (1) or dropped (0) unit"
    return scaled.astype(bool)


@pytest.fixture(scope="module")
def run():
    return train()


def test_masks_differ_across_devices_micro_batches_and_steps(run):
    per_step = masks(run)
    assert per_step.shape == (STEPS, NUM_DEVICES * ACCUM, 64)
    flat = per_step.reshape(-1, 64)
    distinct = {row.tobytes() for row in flat}
    assert len(distinct) == len(flat), "two (step, device, micro-batch) got the same mask"
    assert 0.3 < flat.mean() < 0.7  # rate 0.5


def test_masks_repeat_exactly_with_the_same_seed(run):
    np.testing.assert_array_equal(train(), run)


def test_multisteps_path_draws_the_same_masks(run):
    step = make_step("multisteps")
    state = step.init(Masked())
    sizes = jaxdp.batch_sizes(num_devices=NUM_DEVICES, accum_steps=ACCUM, micro_batch_size=MICRO)
    for rows in batches():
        for call in jaxdp.micro_batches(rows, sizes):
            state, _ = step(state, call)
    np.testing.assert_array_equal(state.params["w"][...], run[-1])


def test_module_seed_decides_the_masks(run):
    class Reseeded(Masked):
        def __init__(self):
            super().__init__()
            self.dropout = nnx.Dropout(0.5, broadcast_dims=(0,), rngs=nnx.Rngs(dropout=8))

    step = make_step()
    state, _ = step(step.init(Reseeded()), batches()[0])
    assert not np.array_equal(masks(np.asarray(state.params["w"][...])[None]), masks(run[:1]))


def test_loss_rng_keyword_differs_per_device_and_micro_batch():
    def loss(params, rows, rng):
        keep = jax.random.bernoulli(rng, 0.5, (len(rows), 64))
        return (params["w"][rows] * keep).sum(axis=1).mean()

    step = jaxdp.make_train_step(
        loss, optax.sgd(1.0), mesh=jaxdp.data_mesh(NUM_DEVICES), accum_steps=ACCUM, rng_seed=3
    )
    w = np.zeros((NUM_DEVICES * ACCUM, 64))
    state, _ = step(step.init({"w": w}), batches()[0])
    drawn = -np.asarray(state.params["w"]) * NUM_DEVICES * ACCUM
    assert len({row.tobytes() for row in drawn}) == NUM_DEVICES * ACCUM
    # The key of device d, micro-batch j is fold_in(fold_in(fold_in(key(3), 0), d), j).
    d, j = 2, 1
    key = jaxdp._model_state.micro_key(jax.random.key(3), 0, d, j)
    expected = jax.random.bernoulli(key, 0.5, (MICRO, 64)).mean(axis=0)
    np.testing.assert_array_equal(drawn[d * ACCUM + j], expected)


def test_two_processes_of_two_devices_equal_one_process_of_four(run, tmp_path):
    with reserved_port() as port:
        _two_processes_equal_one_process_of_four(run, tmp_path, port)


def _two_processes_equal_one_process_of_four(run, tmp_path, port):
    out = tmp_path / "weights.npy"
    here = pathlib.Path(__file__).parent
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(here / "dropout_run.py"), str(i), str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    # Bitwise: the masks, and the sums of zeros and one mask per row, agree exactly.
    np.testing.assert_array_equal(np.load(out), run)
    assert jnp.asarray(run).shape == (STEPS, NUM_DEVICES * ACCUM, 64)

"""Dropout keys: per device and micro-batch, from one seed and the step, whatever the processes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdp
from jaxdp._model_state import micro_key, reseed

NUM_DEVICES, ACCUM, MICRO, WIDTH, STEPS = 4, 2, 2, 64, 3


class Masked(nnx.Module):
    """``w[index] * dropout(ones)`` summed: one step of sgd(1.0) from w = 0 writes each
    (device, micro-batch)'s dropout mask, scaled, into the row of w it indexes."""

    def __init__(self):
        self.w = nnx.Param(jnp.zeros((NUM_DEVICES * ACCUM, WIDTH), jnp.float64))
        # One mask per micro-batch (shared by its rows), so the update shows it whole.
        self.dropout = nnx.Dropout(0.5, broadcast_dims=(0,), rngs=nnx.Rngs(dropout=7))

    def __call__(self, index):
        return (self.w[...][index] * self.dropout(jnp.ones((len(index), WIDTH)))).sum(axis=1)


def loss(model, batch):
    return model(batch).mean()


def batches():
    """Each micro-batch's rows all index its own (device, micro-batch) row of w."""
    rows = np.repeat(np.arange(NUM_DEVICES * ACCUM), MICRO)
    return [rows for _ in range(STEPS)]


def make_step(path="fused"):
    return jaxdp.make_train_step(
        loss,
        optax.sgd(1.0),
        mesh=jaxdp.data_mesh(NUM_DEVICES),
        accum_steps=ACCUM,
        path=path,
    )


def train(place=lambda rows: rows):
    """Weights after every step (numpy), feeding each step's rows through ``place``."""
    step = make_step()
    state, weights = step.init(Masked()), []
    for rows in batches():
        state, _ = step(state, place(rows))
        weights.append(np.asarray(state.params["w"][...].addressable_data(0)))
    return np.stack(weights)


def masks(weights):
    """The (device, micro-batch) dropout masks of each step, from the weight deltas:
    sgd(1.0) moves w[i] by -mask_i / keep / (num_devices * accum_steps)."""
    deltas = np.diff(np.concatenate([np.zeros_like(weights[:1]), weights]), axis=0)
    scaled = -deltas * NUM_DEVICES * ACCUM * 0.5
    assert np.all(np.isin(scaled, [0.0, 1.0])), "each entry is a kept (1) or dropped (0) unit"
    return scaled.astype(bool)


# Jitted for speed only: in each process that derives the masks (three in this file) the 24
# draws op by op took 1.3 s of CPU, one program 0.7 s and 0.2 s once in the compilation cache.
@jax.jit
def drawn_mask(s, d, j):
    """The units Masked keeps at step s, mesh device d and micro-batch j, by the key
    derivation alone (no step, no mesh): a fresh Masked's dropout reseeded as the step
    reseeds it (``micro_key(key, s, d, j)``, its count at 0)."""
    model = Masked()
    nnx.update(model, reseed(nnx.state(model, nnx.RngState), s, d, j))
    return model.dropout(jnp.ones((MICRO, WIDTH)))[0] != 0


def derived_weights():
    """The weights ``train`` must return, from ``drawn_mask``: w moves as ``masks`` reads
    it back. Every value is a multiple of 1/4, so the sums are exact."""
    w, weights = np.zeros((NUM_DEVICES * ACCUM, WIDTH)), []
    for s in range(STEPS):
        kept = [drawn_mask(s, d, j) for d in range(NUM_DEVICES) for j in range(ACCUM)]
        w = w - np.stack(kept) / (0.5 * NUM_DEVICES * ACCUM)
        weights.append(w)
    return np.stack(weights)


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
    key = micro_key(jax.random.key(3), 0, d, j)
    expected = jax.random.bernoulli(key, 0.5, (MICRO, 64)).mean(axis=0)
    np.testing.assert_array_equal(drawn[d * ACCUM + j], expected)


# Together, the two tests below: 2 processes x 2 devices draw, bitwise, the masks of 1 process
# x 4. Each compares with the masks derived from the keys: their device counts differ, so
# they run in different processes (the second in two workers of jaxdp's pytest plugin).
def test_one_process_of_four_draws_the_derived_masks(run):
    assert run.shape == (STEPS, NUM_DEVICES * ACCUM, WIDTH)
    # Bitwise: the masks, and the sums of zeros and one mask per row, agree exactly.
    np.testing.assert_array_equal(run, derived_weights(), strict=True)


@pytest.mark.devices(NUM_DEVICES // 2, processes=2)
def test_two_processes_of_two_devices_draw_the_masks_of_one_process_of_four():
    """Each process (jaxdp's pytest plugin, jaxdp.initialize run) feeds its own devices'
    rows, assembled into the global batch with ``jax.make_array_from_process_local_data``
    (no launcher, no ``process_share``), and checks the replicated weights it holds."""
    assert jax.process_count() == 2 and len(jax.local_devices()) == NUM_DEVICES // 2
    sharding = NamedSharding(jaxdp.data_mesh(NUM_DEVICES), P(jaxdp.DATA_AXIS))
    half = NUM_DEVICES * ACCUM * MICRO // 2  # this process's devices' rows, device-major
    process = jax.process_index()

    def place(rows):
        local = rows[process * half : (process + 1) * half]
        return jax.make_array_from_process_local_data(sharding, local)

    np.testing.assert_array_equal(train(place), derived_weights(), strict=True)

"""The dropout run of tests/test_randomness.py, shared by its in-process run (1 process x 4
devices) and its two-process run (2 processes x 2 devices each, started as
``python dropout_run.py PROCESS_ID PORT OUT.npy``)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdp

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


def main(process_id: int, port: int, out: str) -> None:
    jax.config.update("jax_num_cpu_devices", NUM_DEVICES // 2)
    jax.config.update("jax_enable_x64", True)
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
    assert jax.process_count() == 2 and len(jax.local_devices()) == NUM_DEVICES // 2
    mesh = jaxdp.data_mesh(NUM_DEVICES)
    sharding = NamedSharding(mesh, P(jaxdp.DATA_AXIS))
    half = NUM_DEVICES * ACCUM * MICRO // 2  # this process's devices' rows, device-major

    def place(rows):
        local = rows[process_id * half : (process_id + 1) * half]
        return jax.make_array_from_process_local_data(sharding, local)

    weights = train(place)
    if process_id == 0:
        np.save(out, weights)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

"""What tests/data/format2/ was written from (tests/data/make_format2_checkpoints.py, with
jaxdp 0.2) and what tests/test_checkpoint_format2.py continues it with: the models, data,
optimizers and runs, with no jaxdp step of their own (its options changed spelling)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxdp

N, K, MICRO = 4, 3, 2
SIZES = jaxdp.batch_sizes(num_devices=N, accum_steps=K, micro_batch_size=MICRO)


def mlp(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w0": rng.normal(size=(8, 16)) / 3,
        "b0": np.zeros(16),
        "w1": rng.normal(size=(16, 3)) / 4,
        "b1": np.zeros(3),
    }


def mse(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w0"] + p["b0"]) @ p["w1"] + p["b1"] - y) ** 2)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(8, 16, rngs=rngs, param_dtype=jnp.float64)
        self.bn = nnx.BatchNorm(16, rngs=rngs, param_dtype=jnp.float64, dtype=jnp.float64)
        self.out = nnx.Linear(16, 3, rngs=rngs, param_dtype=jnp.float64)


def net_loss(model, batch):
    x, y = batch
    return jnp.mean((model.out(jax.nn.relu(model.bn(model.fc(x)))) - y) ** 2)


def batches(count, seed=1):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(SIZES.global_batch_size, 8)),
            rng.normal(size=(SIZES.global_batch_size, 3)),
        )
        for _ in range(count)
    ]


CASES = {
    "fused_stage0": dict(path="fused", zero_stage=0, optimizer="adamw"),
    "multisteps_stage0": dict(path="multisteps", zero_stage=0, optimizer="inject"),
    "fused_stage1": dict(path="fused", zero_stage=1, optimizer="adamw"),
    "multisteps_stage2": dict(path="multisteps", zero_stage=2, optimizer="adamw"),
    "multisteps_batchnorm": dict(path="multisteps", zero_stage=0, optimizer="adamw", nnx=True),
}


def optimizer(name):
    if name == "inject":
        return optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=1e-2)
    return optax.adamw(1e-2, weight_decay=1e-2)


def calls(step, state, data):
    """Every call of the run: one per global batch (fused) or micro-batch (multisteps)."""
    out = []
    for batch in data:
        parts = [batch] if step.path == "fused" else jaxdp.micro_batches(batch, SIZES)
        for part in parts:
            state, metrics = step(state, part)
            out.append({k: float(v) for k, v in metrics.items() if np.ndim(v) == 0})
    return state, out

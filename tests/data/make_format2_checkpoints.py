"""Writes tests/data/format2/: checkpoints in jaxdp 0.2's layout (checkpoint format 2),
and what training from each gives, for tests/test_checkpoint_format2.py.

Run once with jaxdp 0.2 (commit 5a621d9) on the path, from a checkout of it:
    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
    PYTHONPATH=. python /path/to/make_format2_checkpoints.py OUT_DIR
"""

import json
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxdp
from jaxdp.checkpoint import Checkpoints

jax.config.update("jax_enable_x64", True)
assert jaxdp.__version__ == "0.2.0", jaxdp.__file__
OUT = sys.argv[1]
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


def main():
    record = {}
    shutil.rmtree(OUT, ignore_errors=True)
    for name, case in CASES.items():
        kw = dict(
            mesh=jaxdp.data_mesh(N),
            accum_steps=K,
            path=case["path"],
            zero_stage=case["zero_stage"],
        )
        if case.get("nnx"):
            step = jaxdp.make_train_step(
                net_loss, optimizer(case["optimizer"]), batch_stats="local", **kw
            )
            state = step.init(Net(nnx.Rngs(0)))
        else:
            step = jaxdp.make_train_step(mse, optimizer(case["optimizer"]), **kw)
            state = step.init(mlp())
        data = batches(4)
        # Two whole steps, then (multisteps) one micro-batch into the third window.
        state, before = calls(step, state, data[:2])
        micro = 0
        if step.path == "multisteps":
            state, _ = step(state, jaxdp.micro_batches(data[2], SIZES)[0])
            micro = 1
        position = jaxdp.SamplerPosition(0, 2, micro)
        Checkpoints(f"{OUT}/{name}").save(state, position=position, sizes=SIZES, samples=0, seed=0)
        # What the run gives from there: the rest of the window, then one more step.
        rest = jaxdp.micro_batches(data[2], SIZES)[micro:] if micro else [data[2]]
        for part in rest:
            state, _ = step(state, part)
        state, after = calls(step, state, [data[3]])
        params = state.params if not case.get("nnx") else nnx.state(step.model(state), nnx.Param)
        leaves = {
            jax.tree_util.keystr(p): np.asarray(x).tolist()
            for p, x in jax.tree_util.tree_leaves_with_path(params)
        }
        record[name] = {"case": case, "params": leaves, "step": int(state.step), "last": after[-1]}
    with open(f"{OUT}/expected.json", "w") as f:
        json.dump(record, f)


main()

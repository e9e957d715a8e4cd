"""Writes tests/data/format2/: checkpoints in jaxdp 0.2's layout (checkpoint format 2),
and what training from each gives, for tests/test_checkpoint_format2.py.

Run once with jaxdp 0.2 (commit 5a621d9) on the path, from a checkout of it:
    XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
    PYTHONPATH=. python /path/to/make_format2_checkpoints.py OUT_DIR
"""

import json
import pathlib
import shutil
import sys

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from format2_cases import CASES, SIZES, Net, batches, calls, mlp, mse, net_loss, optimizer  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp.checkpoint import Checkpoints  # noqa: E402

jax.config.update("jax_enable_x64", True)
assert jaxdp.__version__ == "0.2.0", jaxdp.__file__
OUT = sys.argv[1]
N, K = SIZES.num_devices, SIZES.accum_steps


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

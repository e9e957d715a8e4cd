"""Writes tests/data/format3/: checkpoints in checkpoint format 3 as jaxdp 0.3 wrote them
before issue 31 reshaped the step (commit 4db92fb), with every saved leaf beside them in
``leaves.npz``, for tests/test_checkpoint_format3.py.

Run once from a checkout of that commit:
    PYTHONPATH=. python tests/data/make_format3_checkpoints.py tests/data/format3
"""

import pathlib
import shutil
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from format2_cases import SIZES, batches, mlp, mse, optimizer  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp.checkpoint import Checkpoints  # noqa: E402

# Mid-window on multisteps (the window's sums saved), at a boundary on fused.
CASES = {
    "multisteps_stage0": dict(path="multisteps", zero_stage=0),
    "multisteps_stage2": dict(path="multisteps", zero_stage=2),
    "fused_stage1": dict(path="fused", zero_stage=1),
}


def main(out):
    shutil.rmtree(out, ignore_errors=True)
    for name, case in CASES.items():
        step = jaxdp.make_train_step(
            mse,
            optimizer("inject"),
            mesh=jaxdp.data_mesh(SIZES.num_devices),
            accum_steps=SIZES.accum_steps,
            path=case["path"],
            parallel=jaxdp.Parallel(zero_stage=case["zero_stage"]),
        )
        state = step.init(mlp())
        data = batches(2)
        parts = [data[0]] if step.path == "fused" else jaxdp.micro_batches(data[0], SIZES)
        for part in parts:
            state, _ = step(state, part)
        micro = 0
        if step.path == "multisteps":
            state, _ = step(state, jaxdp.micro_batches(data[1], SIZES)[0])
            micro = 1
        position = jaxdp.SamplerPosition(0, 1, micro)
        Checkpoints(out / name).save(state, position=position, sizes=SIZES, samples=0, seed=0)
        leaves = {
            jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(state)
        }
        np.savez(out / name / "leaves.npz", **leaves)


if __name__ == "__main__":
    jaxdp.emulate_cpu_devices(SIZES.num_devices)
    jax.config.update("jax_enable_x64", True)
    main(pathlib.Path(sys.argv[1]))

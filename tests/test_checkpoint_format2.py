"""Checkpoints written by jaxdp 0.2 (format 2: tests/data/format2/, made by
tests/data/make_format2_checkpoints.py at commit 5a621d9) restore in this jaxdp and
continue as they did in 0.2: fused and multisteps, mid-window, ZeRO stages 1 and 2,
an NNX model with BatchNorm (issue 24, item 6)."""

import json
import pathlib
import shutil
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import jaxdp
from jaxdp.testing import TOLERANCES

DATA = pathlib.Path(__file__).parent / "data"
sys.path.insert(0, str(DATA))
from format2_cases import CASES, SIZES, Net, batches, calls, mlp, mse, net_loss, optimizer  # noqa: E402

EXPECTED = json.loads((DATA / "format2" / "expected.json").read_text())
# float64. Stage 0 and 1 continue bitwise (the same programs' arithmetic); stage 2's new
# reduce-scatter adds each element's four device sums in another order than 0.2's flat
# one: 2.5e-17 relative measured, a few ulps.
RTOL = 1e-13
# Leaves the arithmetic leaves undetermined, with the bound it does set. The BatchNorm
# net's `fc` bias feeds a BatchNorm, which subtracts it again: its gradient is zero in
# exact arithmetic, and what Adam makes of the rounding noise left (1e-17 over its eps of
# 1e-8, times lr 1e-2: about 1e-10 a step; 2e-11 to 3e-8 recorded by 0.2) depends on the
# CPU's instructions (it differed on an AVX-512 machine). A gradient the net does feel
# moves AdamW's leaves by about lr = 1e-2 a step; the bound is far below that.
NOISE = {("multisteps_batchnorm", "['fc']['bias'].value"): 1e-6}


def step_and_like(case):
    kw = dict(
        mesh=jaxdp.data_mesh(SIZES.num_devices),
        accum_steps=SIZES.accum_steps,
        path=case["path"],
        parallel=jaxdp.Parallel(zero_stage=case["zero_stage"]),
    )
    if case.get("nnx"):
        step = jaxdp.make_train_step(
            net_loss, optimizer(case["optimizer"]), batch_stats="local", **kw
        )
        return step, step.init(Net(nnx.Rngs(0)))
    step = jaxdp.make_train_step(mse, optimizer(case["optimizer"]), **kw)
    return step, step.init(mlp())


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_jaxdp_0_2_checkpoint_continues_as_it_did_in_0_2(name, tmp_path):
    shutil.copytree(DATA / "format2" / name, tmp_path / name)  # restore may rename files
    step, like = step_and_like(CASES[name])
    restored = jaxdp.checkpoint.Checkpoints(tmp_path / name).restore(like, sizes=SIZES)
    state, data = restored.state, batches(4)
    micro = restored.position.micro_batch
    assert micro == (1 if step.path == "multisteps" else 0)  # mid-window on multisteps
    if step.path == "multisteps":
        assert int(state.window.position) == micro
    rest = jaxdp.micro_batches(data[2], SIZES)[micro:] if micro else [data[2]]
    for part in rest:
        state, _ = step(state, part)
    state, history = calls(step, state, [data[3]])
    expected = EXPECTED[name]
    assert int(state.step) == expected["step"]
    params = state.params if not CASES[name].get("nnx") else nnx.state(step.model(state), nnx.Param)
    got = {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_leaves_with_path(params)
    }
    assert sorted(got) == sorted(expected["params"])
    for key, value in expected["params"].items():
        if (name, key) in NOISE:  # zero up to rounding noise, here as in 0.2
            assert np.max(np.abs(got[key])) < NOISE[name, key], key
            assert np.max(np.abs(value)) < NOISE[name, key], key
            continue
        np.testing.assert_allclose(
            got[key], value, rtol=RTOL, atol=TOLERANCES["float64"].atol, err_msg=key
        )
    assert history[-1]["loss"] == pytest.approx(expected["last"]["loss"], rel=RTOL)


def test_a_checkpoint_of_an_unknown_format_is_refused_naming_it(tmp_path):
    shutil.copytree(DATA / "format2" / "fused_stage0", tmp_path / "old")
    meta_file = tmp_path / "old" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["format"] = 1
    meta_file.write_text(json.dumps(meta))
    step, like = step_and_like(CASES["fused_stage0"])
    with pytest.raises(
        jaxdp.checkpoint.CheckpointError,
        match=r"meta is format 1; jaxdp 0\.3\.0 reads checkpoint formats 2 \(written by "
        r"jaxdp 0\.2, converted as it is read\) and 3",
    ):
        jaxdp.checkpoint.Checkpoints(tmp_path / "old").restore(like, sizes=SIZES)

"""Issue 31, item 1: one call of the step reads in one place. From ``TrainStep.__call__``
the gradient psum and ``optimizer.update`` are at most 4 jaxdp frames down, all in
jaxdp/_pipeline.py, on both paths and at every ZeRO stage (traced only: the step raises
before anything compiles)."""

import pathlib
import traceback

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp

ROOT = pathlib.Path(jaxdp.__file__).parent


class Reached(Exception):
    pass


def raising_optimizer():
    def update(updates, state, params=None):
        raise Reached

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] - y) ** 2)


def frames_below_call(excinfo):
    """The jaxdp frames between ``TrainStep.__call__`` and the raise, as (file, function)."""
    frames = [
        (pathlib.Path(f.filename).relative_to(ROOT).as_posix(), f.name)
        for f in traceback.extract_tb(excinfo.tb)
        if pathlib.Path(f.filename).is_relative_to(ROOT)
    ]
    call = frames.index(("_step.py", "__call__"))
    return frames[call + 1 :]


@pytest.mark.parametrize("path", ["fused", "multisteps"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@pytest.mark.parametrize("reach", ["optimizer.update", "psum"])
def test_the_psum_and_the_optimizer_are_four_frames_below_the_call(
    path, zero_stage, reach, monkeypatch
):
    optimizer = optax.sgd(0.1)
    if reach == "optimizer.update":
        optimizer = raising_optimizer()
    else:
        psum = jaxdp._pipeline.psum  # jax.lax.psum, or its stand-in over one device

        def reduce_raising(x, axis_name, **kw):
            if isinstance(x, tuple):  # the step's one packed psum of the window's sums
                raise Reached
            return psum(x, axis_name, **kw)

        monkeypatch.setattr(jaxdp._pipeline, "psum", reduce_raising)
    step = jaxdp.make_train_step(
        loss,
        optimizer,
        mesh=jaxdp.data_mesh(2),
        accum_steps=2,
        path=path,
        parallel=jaxdp.Parallel(zero_stage=zero_stage),
    )
    state = step.init({"w": np.ones((3, 2))})
    rows = 8 if path == "fused" else 4
    with pytest.raises(Reached) as excinfo:
        step(state, (np.ones((rows, 3)), np.ones((rows, 2))))
    frames = frames_below_call(excinfo)
    assert len(frames) <= 4, frames
    assert {file for file, _ in frames} == {"_pipeline.py"}, frames
    wanted = "reduce" if reach == "psum" else "apply"
    assert frames[-1] == ("_pipeline.py", wanted), frames

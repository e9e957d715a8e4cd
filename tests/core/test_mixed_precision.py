"""Mixed precision (docs/semantics.md, "Mixed precision"): bfloat16 matmuls on float32
parameters leave the parameters, Adam's moments and the gradient accumulator in
float32 on both paths, with gradients on the wire in either dtype.

The conftest enables float64, so a dtype that followed JAX's default float instead of
the parameters (or ``accum_dtype``'s default) would show here as float64. Matmul and
wire dtypes are read from the program jaxdp hands XLA (``compiler_ir("hlo")``):
XLA:CPU computes bfloat16 dots and all-reduces in float32 in its own passes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdp
from jaxdp._inspect import instructions

NUM_DEVICES, ACCUM_STEPS, MICRO = 4, 2, 2
STEPS = 2
# Every trainable leaf of MixedMLP: the two kernels and the two biases.
SHAPES = {(4, 8), (8,), (8, 1), (1,)}


class MixedMLP(nnx.Module):
    """Matmuls in ``dtype`` on parameters stored in ``param_dtype`` (flax casts them
    on every call; the cast is differentiable, so gradients come back in
    ``param_dtype``)."""

    def __init__(self, dtype=jnp.bfloat16, param_dtype=jnp.float32):
        kw = {"dtype": dtype, "param_dtype": param_dtype, "rngs": nnx.Rngs(0)}
        self.hidden = nnx.Linear(4, 8, **kw)
        self.out = nnx.Linear(8, 1, **kw)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def mse(model, batch):
    x, y = batch
    return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)  # the loss in float32


def make(path, comm_dtype=None, optimizer=None):
    return jaxdp.make_train_step(
        mse,
        optimizer or optax.adamw(1e-2),
        mesh=jaxdp.data_mesh(NUM_DEVICES),
        accum_steps=ACCUM_STEPS,
        path=path,
        parallel=jaxdp.Parallel(comm_dtype=comm_dtype),
    )


def call_batch(step, seed=0):
    rows = NUM_DEVICES * MICRO * (ACCUM_STEPS if step.path == "fused" else 1)
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, 4)).astype(np.float32), rng.normal(size=(rows, 1)).astype(
        np.float32
    )


def dtypes(tree) -> set[str]:
    return {str(x.dtype) for x in jax.tree.leaves(tree)}


def program(step, state) -> str:
    """The HLO of one call as jaxdp hands it to XLA, before XLA's passes."""
    return step.lower(state, call_batch(step)).compiler_ir("hlo").as_hlo_text()


def dot_dtypes(hlo: str) -> set[str]:
    """The result dtypes of the program's matmuls, forward and backward."""
    return {i.shapes[0].split("[")[0] for i in instructions(hlo) if i.opcode == "dot"}


def optimizer_steps(step, state):
    """``STEPS`` optimizer steps: the window's sums are checked mid-window too."""
    calls = STEPS * (1 if step.path == "fused" else ACCUM_STEPS)
    for call in range(calls):
        state, metrics = step(state, call_batch(step, seed=call))
        assert bool(metrics["finite"])
        if step.path == "multisteps" and call % ACCUM_STEPS < ACCUM_STEPS - 1:
            assert dtypes(state.window.grads) == {"float32"}
            assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(state.window.grads))
    assert int(state.step) == STEPS
    return state


@pytest.mark.parametrize("comm_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_parameters_moments_and_accumulator_stay_float32(path, comm_dtype):
    step = make(path, comm_dtype)
    start = step.init(MixedMLP())
    before = jax.tree.map(np.array, start.params)
    state = optimizer_steps(step, start)
    assert dtypes(state.params) == {"float32"}
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before), strict=True):
        assert not np.array_equal(np.asarray(a), b)  # trained
    adam = state.opt_state[0]
    assert dtypes(adam.mu) == dtypes(adam.nu) == {"float32"}
    assert all(np.any(np.asarray(v) != 0) for v in jax.tree.leaves(adam.nu))
    if path == "multisteps":
        window = state.window
        assert dtypes(window.grads) == {"float32"}
        assert {tuple(g.shape[1:]) for g in jax.tree.leaves(window.grads)} == SHAPES
        assert window.grads["hidden"]["kernel"].shape[0] == NUM_DEVICES  # a row per device
        assert str(window.loss_sum.dtype) == str(window.weight.dtype) == "float32"
    else:
        assert state.window is None


@pytest.mark.parametrize("path", ["fused", "multisteps"])
@pytest.mark.parametrize(("compute", "hlo_dtype"), [(jnp.bfloat16, "bf16"), (jnp.float32, "f32")])
def test_matmuls_run_in_the_model_dtype(path, compute, hlo_dtype):
    step = make(path)
    state = step.init(MixedMLP(dtype=compute))
    assert dtypes(state.params) == {"float32"}
    assert dot_dtypes(program(step, state)) == {hlo_dtype}


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_bfloat16_on_the_wire_only_for_the_gradients(path):
    """``comm_dtype="bfloat16"``: each gradient leaf's all-reduce sums bfloat16 (the
    accumulator's sums divided by ``num_devices``, cast); the loss and weight sums
    travel in float32, and the window keeps its float32 sums."""
    for comm_dtype, wire in ((None, "f32"), ("bfloat16", "bf16")):
        step = make(path, comm_dtype)
        state = step.init(MixedMLP())
        reduces = jaxdp.testing.all_reduces(program(step, state))
        gradients = [r.shapes[0] for r in reduces if r.shapes[0] != "f32[]"]
        assert len(gradients) == len(SHAPES), jaxdp.testing.format_report(reduces)
        assert {s.split("[")[0] for s in gradients} == {wire}, gradients
        assert [r.shapes for r in reduces].count(("f32[]",)) == 2  # the loss and weight sums
        if path == "multisteps":
            assert dtypes(state.window.grads) == {"float32"}


def loop_carries(hlo: str) -> set[str]:
    """The arrays a ``while`` loop (the fused path's scan) carries from one micro-batch
    to the next."""
    return {s for i in instructions(hlo) if i.opcode == "while" for s in i.shapes}


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_bfloat16_parameters_accumulate_in_float32(path):
    """Parameters stored in bfloat16: gradients come in bfloat16, the accumulator adds
    them in float32 (``accum_dtype``'s default), the optimizer state follows optax
    (``nu`` in the parameters' dtype, ``mu`` in ``mu_dtype``)."""
    step = make(path, optimizer=optax.adamw(1e-2, mu_dtype=jnp.float32))
    state = step.init(MixedMLP(param_dtype=jnp.bfloat16))
    if path == "fused":  # the sums live inside the scan: float32 kernels among its carries
        assert {"f32[4,8]", "f32[8,1]"} <= loop_carries(program(step, state))
    state = optimizer_steps(step, state)
    assert dtypes(state.params) == {"bfloat16"}
    adam = state.opt_state[0]
    assert (dtypes(adam.mu), dtypes(adam.nu)) == ({"float32"}, {"bfloat16"})
    if path == "multisteps":
        assert dtypes(state.window.grads) == {"float32"}

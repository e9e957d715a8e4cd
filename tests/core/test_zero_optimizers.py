"""ZeRO stages 1 and 2 compute what stage 0 computes for optimizers that read more than
an element: whole-tree and per-leaf norms, factored moments, masks by shape, wrappers
(issue 24, acceptance 2). 4 devices, float64, 10 steps, both stages and both paths
(SPLIT_RUNS)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ATOL, assert_trees_close
from models import regression_data, train

import jaxdp

# 1e-12 relative, the bound: stage 0 and the split stages differ only in the
# order of the sums (a reduce-scatter, a norm over blocks), a few ulps in float64.
RTOL = 1e-12
STEPS, GLOBAL_BATCH = 10, 16
# Sizes with a 128 x 128 kernel, so adafactor factors its second moment (it does from 128).
SIZES = (8, 128, 128, 3)


def params():
    rng = np.random.default_rng(0)
    out = {}
    for i, (m, n) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True)):
        out[f"w{i}"] = rng.normal(size=(m, n)) / np.sqrt(m)
        out[f"b{i}"] = 0.1 * rng.normal(size=n)
    return out


def loss(p, batch):
    x, y = batch
    for i in range(3):
        x = x @ p[f"w{i}"] + p[f"b{i}"]
        x = jnp.tanh(x) if i < 2 else x
    return jnp.mean((x - y) ** 2)


def by_size(tree):
    return jax.tree.map(lambda x: x.size > 1000, tree)


# name: (optimizer, the largest clip threshold in it: every step's gradient norm exceeds it)
OPTIMIZERS = {
    "adafactor": (lambda: optax.adafactor(1e-2), 0),
    "lamb": (lambda: optax.lamb(1e-2), 0),
    "lars": (lambda: optax.lars(0.1), 0),
    "adaptive_grad_clip_sgd": (
        lambda: optax.chain(optax.adaptive_grad_clip(0.01), optax.sgd(0.5)),
        0,
    ),
    "chain_clip_0.5": (
        lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1e-2)),
        0.5,
    ),
    "chain_clip_20": (lambda: optax.chain(optax.clip_by_global_norm(20.0), optax.sgd(1e-2)), 20),
    "named_chain_clip": (
        lambda: optax.named_chain(
            ("clip", optax.clip_by_global_norm(1.0)), ("sgd", optax.sgd(1e-2))
        ),
        1.0,
    ),
    "inject_hyperparams_chain_clip_20": (
        lambda: optax.inject_hyperparams(
            lambda lr: optax.chain(optax.clip_by_global_norm(20.0), optax.sgd(lr))
        )(lr=0.05),
        20,
    ),
    "adamw_mask_by_size": (
        lambda: optax.chain(
            optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1, mask=by_size)
        ),
        0.5,
    ),
    "apply_if_finite_adam": (lambda: optax.apply_if_finite(optax.adam(1e-2), 3), 0),
    "multi_transform": (
        lambda: optax.multi_transform(
            {"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2, momentum=0.9)},
            lambda p: {k: "adam" if k.startswith("w") else "sgd" for k in p},
        ),
        0,
    ),
}


def data():
    x, y = regression_data(GLOBAL_BATCH * STEPS, sizes=(SIZES[0], SIZES[-1]))
    y = 30 * y  # gradients with a norm far above every clip threshold
    return [(x[i::STEPS], y[i::STEPS]) for i in range(STEPS)]


def run(name, stage, path):
    step = jaxdp.make_train_step(
        loss,
        OPTIMIZERS[name][0](),
        mesh=jaxdp.data_mesh(4),
        accum_steps=2,
        path=path,
        parallel=jaxdp.Parallel(zero_stage=stage),
    )
    return train(step, params(), data())


# Each optimizer at one split stage on one path, the four (stage, path) pairs in rotation
# from one optimizer to the next: each pair meets two or three optimizers. What these
# optimizers test is how the update reads the split state and gradients (norms over
# blocks, factored moments, masks by shape), and that is one code for both stages and
# both paths: stage 2 differs from stage 1 only in where the gradients are
# reduce-scattered (each micro-batch, not the window's sum), and the paths in how the
# sums are accumulated; both are the equivalence grid's (tests/core/test_equivalence.py,
# every (stage, path) with the clip and the decayed weights) and test_zero.py's. Was:
# four runs per optimizer (44 in all), then stage 1 on one path and stage 2 on the other
# (22).
PAIRS = ((1, "fused"), (2, "multisteps"), (1, "multisteps"), (2, "fused"))
SPLIT_RUNS = {name: (PAIRS[i % len(PAIRS)],) for i, name in enumerate(sorted(OPTIMIZERS))}


def test_the_split_runs_meet_every_stage_and_path():
    runs = [run for runs in SPLIT_RUNS.values() for run in runs]
    assert set(runs) == set(PAIRS) and len(runs) == len(OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_stages_1_and_2_equal_stage_0(name):
    expected, history = run(name, 0, "fused")
    assert int(expected.step) == STEPS
    assert min(float(m["grad_norm"]) for m in history) > OPTIMIZERS[name][1]  # clips act
    moved = max(
        float(np.max(np.abs(np.asarray(a) - b)))
        for a, b in zip(jax.tree.leaves(expected.params), jax.tree.leaves(params()), strict=True)
    )
    assert moved > 1e-3  # the comparison is of a trained model
    for stage, path in SPLIT_RUNS[name]:
        state, _ = run(name, stage, path)
        assert int(state.step) == STEPS
        assert_trees_close(state.params, expected.params, rtol=RTOL, atol=ATOL["float64"])
        # The optimizer state too, leaf by leaf in the same shapes: only where it lies differs.
        assert_trees_close(state.opt_state, expected.opt_state, rtol=RTOL, atol=ATOL["float64"])

"""Acceptance 1: (N devices, K micro-batches) == one big batch on one device, on every
path, strategy and ZeRO stage, under both spellings of the step: the suite's one grid of
this equivalence.

The spellings (issue 31, item 5): a CPU mesh takes the step's XLA:CPU spellings
(jaxdp/_pipeline.py, "XLA:CPU spelling": the multiply by 1 / weight, the ``lax.cond``
skip, the reset from the sums); ``jaxdp.testing.plain_spelling()`` makes the steps built
inside take the plain ones every GPU and TPU takes (the divide, the select, fresh zeros),
here on the CPU mesh. The non-finite skip under both spellings is in
tests/core/test_nonfinite.py; the torch parity cell per ZeRO stage under the plain
spelling is parity_tests/test_parity_zero.py::test_plain_spelling_matches_torch.
"""

import contextlib
import re

import jax
import numpy as np
import optax
import pytest
from helpers import ATOL, RTOL, assert_trees_close
from models import OPTIMIZERS, big_batch_reference, mlp_params, mse_loss, regression_data, train

import jaxdp
from jaxdp.testing import plain_spelling

GLOBAL_BATCH = 64  # divisible by every num_devices * accum_steps below
STEPS = 5
# The split stages also meet optimizers that read more than an element: a weight decay
# under Nesterov momentum, and a clip whose max_norm is below the MLP's gradient norms
# (about 1), so it acts on every step and its norm must be of the whole gradient, not of
# a device's shard. tests/core/test_zero_optimizers.py takes eleven more.
ZERO_OPTIMIZERS = {
    "sgd_nesterov_wd": lambda: optax.chain(
        optax.add_decayed_weights(1e-2), optax.sgd(0.05, momentum=0.9, nesterov=True)
    ),
    "adamw_clip": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=1e-2)
    ),
}
ALL_OPTIMIZERS = {**OPTIMIZERS, **ZERO_OPTIMIZERS}
SPELLINGS = ("cpu", "plain")  # the CPU mesh's own, and every other backend's


def made_in(spelling):
    """The context a step of that spelling is made in (the choice is made then)."""
    return plain_spelling() if spelling == "plain" else contextlib.nullcontext()


def conditionals(step, batch):
    state = step.init(mlp_params())
    return len(re.findall(r"\bconditional\(", step.compile(state, batch).as_text()))


def test_the_switch_picks_the_spelling_when_the_step_is_made():
    def make():
        return jaxdp.make_train_step(
            mse_loss, OPTIMIZERS["adamw"](), mesh=jaxdp.data_mesh(2), accum_steps=2
        )

    batch = regression_data(GLOBAL_BATCH)
    with plain_spelling():
        plain = make()
    cpu = make()  # after the block: the CPU mesh's own spelling again
    assert plain.options.cpu_spelling is False and cpu.options.cpu_spelling is True
    # The fused step's one conditional is the CPU spelling's skip (a lax.cond); the plain
    # spelling selects, also when traced after the block has closed.
    assert conditionals(cpu, batch) == 1
    assert conditionals(plain, batch) == 0


@pytest.fixture(scope="module")
def batches():
    x, y = regression_data(GLOBAL_BATCH * STEPS)
    return [(x[i::STEPS], y[i::STEPS]) for i in range(STEPS)]


@pytest.fixture(scope="module")
def reference(batches):
    return {
        name: big_batch_reference(mse_loss, make(), mlp_params(), batches)
        for name, make in ALL_OPTIMIZERS.items()
    }


def cells():
    """(num_devices, accum_steps, optimizer, path, strategy, zero_stage, spelling), in
    three parts, each cell run once under one spelling.

    - shard_map, stage 0: every (N, K, path), each cell with one of the two optimizers,
      alternating so that each meets every (N, K) and both paths (the optimizer sees only
      the averaged gradient; which one runs in a cell does not touch the split, but its
      state's handling on each path must be checked).
    - pmap (stage 0 only): the cells that differ in kind from its others: one device, no
      accumulation, and the most devices with the most micro-batches, on both paths.
      The split and the reduction are the step's own, the same under either strategy;
      what pmap changes is how the per-device program is mapped (every shard_map cell
      above runs the same arithmetic).
    - ZeRO stages 1 and 2 (shard_map): 2 and 4 devices with several micro-batches, both
      paths, the optimizers alternating so that each stage meets the clip and the
      decayed weights (was tests/core/test_zero.py::test_stages_1_and_2_train_as_one_big_batch).

    The spelling alternates over the cells (was a second grid of 54 cells beside this one,
    tests/core/test_gpu_spelling.py, every cell under the plain spelling): the two paths of
    an (N, K) take different spellings, so each spelling meets every (N, K) at stage 0 and
    both paths; the pmap layouts alternate, so each meets pmap on both paths; the two ZeRO
    layouts of a (stage, path) take different spellings, so each meets every (stage, path).
    The spelling changes how the step divides, skips and resets, not the split or the
    reduction, which the other axes cover.
    """
    names = sorted(OPTIMIZERS)
    out = [
        (n, k, names[(ni + ki + pi) % len(names)], path, "shard_map", 0, SPELLINGS[(ni + pi) % 2])
        for ni, n in enumerate([1, 2, 4, 8])
        for ki, k in enumerate([1, 2, 4])
        for pi, path in enumerate(["fused", "multisteps"])
    ]
    out += [
        (n, k, names[(i + pi) % len(names)], path, "pmap", 0, SPELLINGS[i % 2])
        for i, (n, k) in enumerate([(1, 2), (2, 1), (8, 4)])
        for pi, path in enumerate(["fused", "multisteps"])
    ]
    zero = sorted(ZERO_OPTIMIZERS) + ["sgd_momentum"]
    out += [
        (
            n,
            k,
            zero[(ni + pi + si) % len(zero)],
            path,
            "shard_map",
            stage,
            SPELLINGS[(ni + pi + si) % 2],
        )
        for ni, (n, k) in enumerate([(2, 4), (4, 2)])
        for pi, path in enumerate(["fused", "multisteps"])
        for si, stage in enumerate([1, 2])
    ]
    return out


GRID = cells()


@pytest.mark.parametrize(
    ("num_devices", "accum_steps", "optimizer", "path", "strategy", "zero_stage", "spelling"),
    GRID,
    ids=["-".join(map(str, cell)) for cell in GRID],
)
def test_data_parallel_accumulation_equals_big_batch(
    batches, reference, num_devices, accum_steps, optimizer, path, strategy, zero_stage, spelling
):
    with made_in(spelling):
        step = jaxdp.make_train_step(
            mse_loss,
            ALL_OPTIMIZERS[optimizer](),
            mesh=jaxdp.data_mesh(num_devices),
            accum_steps=accum_steps,
            path=path,
            parallel=jaxdp.Parallel(strategy=strategy, zero_stage=zero_stage),
        )
    assert step.options.cpu_spelling is (spelling == "cpu")
    state, history = train(step, mlp_params(), batches)
    assert int(state.step) == STEPS
    assert all(m["finite"] for m in history)
    # The split stages sum in another order (a reduce-scatter, norms over shards): a few
    # ulps, with ATOL's floor for elements near zero (as their own tests had it); a wrong
    # shard or a norm of one device's shard moves the weights by 1e-3 or more.
    atol = ATOL["float64"] if zero_stage else 0.0
    assert_trees_close(state.params, reference[optimizer], rtol=RTOL["float64"], atol=atol)


def test_the_grid_meets_every_kind_of_cell():
    """What the thinned parts still cover, so that a later edit cannot drop it unseen."""
    zero = [c for c in GRID if c[5]]
    assert {(c[3], c[5]) for c in zero} == {(p, s) for p in ("fused", "multisteps") for s in (1, 2)}
    for stage in (1, 2):  # every stage meets the clip and the decayed weights
        assert {c[2] for c in zero if c[5] == stage} >= set(ZERO_OPTIMIZERS)
    pmap = [c for c in GRID if c[4] == "pmap"]
    assert {c[3] for c in pmap} == {"fused", "multisteps"} and {c[2] for c in pmap} == set(
        OPTIMIZERS
    )
    assert {c[0] for c in pmap} >= {1, 8} and {c[1] for c in pmap} >= {1, 4}
    plain = {(c[0], c[1], c[3]) for c in GRID if c[4] == "shard_map" and not c[5]}
    assert len(plain) == 4 * 3 * 2
    # Each spelling meets every (N, K) at stage 0, both paths, both strategies, every ZeRO
    # stage, and every (stage, path) pair (the non-finite skip: test_nonfinite.py).
    for name in SPELLINGS:
        mine = [c for c in GRID if c[6] == name]
        stage_0 = {(c[0], c[1]) for c in mine if c[4] == "shard_map" and not c[5]}
        assert stage_0 == {(n, k) for n in (1, 2, 4, 8) for k in (1, 2, 4)}, name
        assert {c[4] for c in mine} == {"shard_map", "pmap"}, name
        assert {c[3] for c in mine if c[4] == "pmap"} == {"fused", "multisteps"}, name
        assert {(c[5], c[3]) for c in mine} == {
            (s, p) for s in (0, 1, 2) for p in ("fused", "multisteps")
        }, name


# Every (N, K) on both paths, the optimizers alternating as in the float64 grid: each
# meets every (N, K) and both paths (float32 changes the rounding, not the optimizer's
# part; 12 cells before, every optimizer in every cell).
FLOAT32_GRID = [
    (n, k, sorted(OPTIMIZERS)[(i + pi) % len(OPTIMIZERS)], path)
    for i, (n, k) in enumerate([(1, 4), (2, 2), (8, 4)])
    for pi, path in enumerate(["fused", "multisteps"])
]


@pytest.mark.parametrize(("num_devices", "accum_steps", "optimizer", "path"), FLOAT32_GRID)
def test_float32_within_named_tolerance(num_devices, accum_steps, optimizer, path):
    x, y = regression_data(GLOBAL_BATCH * STEPS, dtype=np.float32)
    batches = [(x[i::STEPS], y[i::STEPS]) for i in range(STEPS)]
    params = mlp_params(dtype=np.float32)
    expected = big_batch_reference(mse_loss, OPTIMIZERS[optimizer](), params, batches)
    step = jaxdp.make_train_step(
        mse_loss,
        OPTIMIZERS[optimizer](),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        path=path,
    )
    state, _ = train(step, params, batches)
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(state.params))
    assert_trees_close(state.params, expected, rtol=RTOL["float32"], atol=ATOL["float32"])

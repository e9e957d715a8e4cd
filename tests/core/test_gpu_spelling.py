"""Issue 31, item 5: the spelling every GPU (and TPU) takes, run on the CPU mesh.

A CPU mesh takes the step's XLA:CPU spellings (jaxdp/_pipeline.py, "XLA:CPU
spelling": the multiply by 1 / weight, the ``lax.cond`` skip, the reset from the
sums); ``jaxdp.testing.plain_spelling()`` makes the steps built inside take the plain
ones (the divide, the select, fresh zeros). Here: that the switch reaches the
compiled program, the equivalence grid (N devices x K micro-batches == one big batch,
both paths, ZeRO 0/1/2) and the non-finite skip under it. The torch parity cell per
ZeRO stage is parity_tests/test_parity_zero.py::test_plain_spelling_matches_torch.
"""

import re

import jax
import numpy as np
import pytest
from helpers import RTOL, assert_trees_close
from models import OPTIMIZERS, big_batch_reference, mlp_params, mse_loss, regression_data, train

import jaxdp
from jaxdp.testing import plain_spelling

GLOBAL_BATCH = 32  # divisible by every num_devices * accum_steps below
STEPS = 3


def make(num_devices=2, accum_steps=2, path="fused", zero_stage=0, optimizer="adamw", **kw):
    return jaxdp.make_train_step(
        mse_loss,
        OPTIMIZERS[optimizer](),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        path=path,
        parallel=jaxdp.Parallel(zero_stage=zero_stage),
        **kw,
    )


def conditionals(step, batch):
    state = step.init(mlp_params())
    return len(re.findall(r"\bconditional\(", step.compile(state, batch).as_text()))


def test_the_switch_picks_the_spelling_when_the_step_is_made():
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
        name: big_batch_reference(mse_loss, make_opt(), mlp_params(), batches)
        for name, make_opt in OPTIMIZERS.items()
    }


# Every (num_devices, accum_steps, path, ZeRO stage) cell, the two optimizers alternating.
GRID = [
    (n, k, path, stage, sorted(OPTIMIZERS)[(ni + ki + pi + stage) % len(OPTIMIZERS)])
    for ni, n in enumerate([1, 2, 4])
    for ki, k in enumerate([1, 2, 4])
    for pi, path in enumerate(["fused", "multisteps"])
    for stage in (0, 1, 2)
]


@pytest.mark.parametrize(
    ("num_devices", "accum_steps", "path", "zero_stage", "optimizer"),
    GRID,
    ids=["-".join(map(str, cell)) for cell in GRID],
)
def test_plain_spelling_accumulation_equals_big_batch(
    batches, reference, num_devices, accum_steps, path, zero_stage, optimizer
):
    with plain_spelling():
        step = make(num_devices, accum_steps, path, zero_stage, optimizer)
    state, _ = train(step, mlp_params(), batches)
    assert int(state.step) == STEPS
    assert_trees_close(state.params, reference[optimizer], rtol=RTOL["float64"])


def poisoned(batch):
    x, y = (a.copy() for a in batch)
    x[GLOBAL_BATCH // 2 + 1, 3] = np.nan  # a row of the second device's
    return x, y


def run(step, data):
    state, skipped = step.init(mlp_params()), []
    for batch in data:
        sizes = jaxdp.batch_sizes(
            num_devices=step.num_devices,
            accum_steps=step.accum_steps,
            global_batch_size=len(batch[0]),
        )
        for call in [batch] if step.path == "fused" else jaxdp.micro_batches(batch, sizes):
            state, metrics = step(state, call)
            skipped.append(bool(metrics["skipped"]))
    return state, skipped


@pytest.mark.parametrize("path", ["fused", "multisteps"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_plain_spelling_skips_a_nan_step_as_if_its_batch_never_came(batches, path, zero_stage):
    with plain_spelling():
        step = make(2, 2, path, zero_stage)
        clean_step = make(2, 2, path, zero_stage)
    state, skipped = run(step, [batches[0], poisoned(batches[1]), batches[2]])
    clean, _ = run(clean_step, [batches[0], batches[2]])
    per_step = 1 if path == "fused" else 2
    assert skipped == [False] * (2 * per_step - 1) + [True] + [False] * per_step
    assert int(state.step) == 2 and int(state.skipped_steps) == 1
    # Bitwise: the select kept parameters and optimizer state, the window restarted at zero.
    for a, b in zip(
        jax.tree.leaves((state.params, state.opt_state, state.window)),
        jax.tree.leaves((clean.params, clean.opt_state, clean.window)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_plain_spelling_with_skips_off_lets_nan_through(batches):
    with plain_spelling():
        step = make(2, 2, "multisteps", skips=jaxdp.Skips(nonfinite=False))
    state, skipped = run(step, [poisoned(batches[0])])
    assert skipped == [False, False] and int(state.step) == 1
    assert all(np.isnan(np.asarray(x)).any() for x in jax.tree.leaves(state.params))

"""Non-finite steps: every replica skips them identically, as if the batch never came,
under both spellings of the step (the CPU mesh's ``lax.cond`` skip and reset from the sums,
and the select and fresh zeros every other backend takes: jaxdp.testing.plain_spelling)."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdp
from jaxdp.testing import plain_spelling

NUM_DEVICES, ACCUM, MICRO = 4, 2, 4


class Net(nnx.Module):
    """Every kind of state: parameters, batch statistics, a dropout stream."""

    def __init__(self):
        rngs = nnx.Rngs(0, dropout=1)
        self.fc = nnx.Linear(6, 16, param_dtype=jnp.float64, rngs=rngs)
        self.bn = jaxdp.models.BatchNorm(16, param_dtype=jnp.float64)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(16, 1, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(jax.nn.relu(self.bn(self.fc(x)))))


def loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def batches(count=4):
    rng = np.random.default_rng(0)
    rows = NUM_DEVICES * ACCUM * MICRO
    out = []
    for _ in range(count):
        x = rng.normal(size=(rows, 6))
        out.append((x, np.sin(x).sum(axis=1, keepdims=True)))
    return out


def poisoned(batch, device, micro_batch, value=np.nan):
    x, y = (a.copy() for a in batch)
    x[(device * ACCUM + micro_batch) * MICRO + 1, 2] = value
    return x, y


def make(path, strategy="shard_map", zero_stage=0, spelling="cpu", **kw):
    with plain_spelling() if spelling == "plain" else contextlib.nullcontext():
        step = jaxdp.make_train_step(
            loss,
            optax.adamw(1e-2, weight_decay=1e-2),
            mesh=jaxdp.data_mesh(NUM_DEVICES),
            accum_steps=ACCUM,
            path=path,
            batch_stats="local",
            parallel=jaxdp.Parallel(strategy=strategy, zero_stage=zero_stage),
            **kw,
        )
    assert step.options.cpu_spelling is (spelling == "cpu")
    return step


def calls(step, batch):
    if step.path == "fused":
        return [batch]
    sizes = jaxdp.batch_sizes(num_devices=NUM_DEVICES, accum_steps=ACCUM, micro_batch_size=MICRO)
    return list(jaxdp.micro_batches(batch, sizes))


def run(step, data):
    state, history = step.init(Net()), []
    for batch in data:
        for call in calls(step, batch):
            state, metrics = step(state, call)
            history.append(jax.device_get(metrics))
    return state, history


def host(state):
    """Everything a step may change, as numpy by path (rng keys as their data)."""
    tree = (state.step, state.params, state.opt_state, state.model_state)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(_plain(x)) for path, x in leaves}


# Each spelling meets both paths, both strategies and every ZeRO stage; every (path,
# strategy) and every (path, stage) is met, the spelling alternating (was: the first four
# cells under the CPU spelling, and tests/core/test_gpu_spelling.py's six under the plain
# one, every (path, stage) on 2 devices x 2 micro-batches, an MLP without model state).
SKIP_CELLS = [
    ("fused", "shard_map", 0, "cpu", 1, 1),
    ("fused", "pmap", 0, "plain", 0, 0),
    ("multisteps", "shard_map", 0, "plain", 0, 0),
    ("multisteps", "pmap", 0, "cpu", 3, 1),
    ("fused", "shard_map", 1, "plain", 2, 1),
    ("multisteps", "shard_map", 1, "cpu", 1, 0),
    ("fused", "shard_map", 2, "cpu", 3, 0),
    ("multisteps", "shard_map", 2, "plain", 2, 1),
]


def test_the_skip_cells_meet_every_kind_of_cell():
    for spelling in ("cpu", "plain"):
        mine = [c for c in SKIP_CELLS if c[3] == spelling]
        assert {c[0] for c in mine} == {"fused", "multisteps"}
        assert {c[1] for c in mine} == {"shard_map", "pmap"}
        assert {c[2] for c in mine} == {0, 1, 2}
    assert {(c[0], c[2]) for c in SKIP_CELLS} == {
        (p, s) for p in ("fused", "multisteps") for s in (0, 1, 2)
    }
    assert {(c[0], c[1]) for c in SKIP_CELLS} == {
        (p, s) for p in ("fused", "multisteps") for s in ("shard_map", "pmap")
    }


@pytest.mark.parametrize(
    "path, strategy, zero_stage, spelling, device, micro_batch",
    SKIP_CELLS,
    ids=["-".join(map(str, cell)) for cell in SKIP_CELLS],
)
def test_nan_on_one_device_skips_the_step_everywhere_like_a_run_without_that_batch(
    path, strategy, zero_stage, spelling, device, micro_batch
):
    data = batches()
    mesh = jaxdp.data_mesh(NUM_DEVICES)
    step = make(path, strategy, zero_stage, spelling)
    state, history = step.init(Net()), []
    for batch in [data[0], poisoned(data[1], device, micro_batch), data[2], data[3]]:
        before = host(state)  # the window's start: a skip returns to it, window restarted
        for call in calls(step, batch):
            state, metrics = step(state, call)
            history.append(jax.device_get(metrics))
            # The optimizer state too, but for the multisteps path's per-device rows.
            opt = [x for x in jax.tree.leaves(state.opt_state) if x.sharding.is_fully_replicated]
            trees = {"params": state.params, "model_state": state.model_state, "opt_state": opt}
            for name, tree in trees.items():
                jaxdp.check_replicas(jax.tree.map(_plain, tree), mesh, name=name)
            if metrics["skipped"]:  # nothing moved: parameters, optimizer, statistics, step
                np.testing.assert_equal(host(state), before)
    # The run without that batch: the same step (its compiled programs) from a fresh state.
    clean, _ = run(step, [data[0], data[2], data[3]])

    skipped = [bool(m["skipped"]) for m in history]
    per_step = 1 if path == "fused" else ACCUM
    assert skipped == [False] * (2 * per_step - 1) + [True] + [False] * (2 * per_step)
    assert int(state.step) == 3 and int(state.skipped_steps) == 1
    assert int(history[2 * per_step - 1]["consecutive_skips"]) == 1
    assert int(history[-1]["consecutive_skips"]) == 0
    assert np.isnan(history[2 * per_step - 1]["loss"])
    # Bitwise: the skipped step changed nothing, not even the dropout keys' step, and the
    # window restarted where a run without that batch has it.
    np.testing.assert_equal(host(state), host(clean))
    for a, b in zip(jax.tree.leaves(state.window), jax.tree.leaves(clean.window), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _plain(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def test_inf_counts_as_non_finite():
    data = batches(2)
    step = make("fused")
    state, history = run(step, [poisoned(data[0], 2, 0, np.inf), data[1]])
    assert [bool(m["skipped"]) for m in history] == [True, False]
    assert int(state.step) == 1


def skip_twice(step, data):
    """A finite step, then two skipped ones (the limit of 2): (state, good params)."""
    state, _ = step(step.init(Net()), data[0])
    good = host(state)
    state, _ = step(state, poisoned(data[1], 0, 0))
    state, metrics = step(state, poisoned(data[2], 3, 1))
    assert int(metrics["consecutive_skips"]) == 2
    return state, good


def test_consecutive_skips_stop_training_with_the_last_good_state():
    data = batches(4)
    step = make("fused", skips=jaxdp.Skips(max_consecutive=2))
    state, good = skip_twice(step, data)
    # The step watches two calls behind (no host sync every call): the next call
    # sees the limit's call still running or just done, and goes on ...
    state, _ = step(state, poisoned(data[3], 1, 0))
    # ... and the one after it raises, before using its batch, as the run of
    # skips went on past the limit.
    with pytest.raises(
        jaxdp.NonFiniteError, match=r"3 optimizer steps in a row.*max_consecutive_skips=2.*step 1"
    ) as error:
        step(state, data[0])
    np.testing.assert_equal(host(error.value.state), good)
    assert int(error.value.state.skipped_steps) == 3


def test_a_finite_step_after_the_limit_ends_the_run_of_skips():
    data = batches(4)
    step = make("fused", skips=jaxdp.Skips(max_consecutive=2))
    state, _ = skip_twice(step, data)
    state, metrics = step(state, data[3])  # finite: applied, the run is over
    assert int(metrics["consecutive_skips"]) == 0
    state, _ = step(state, data[0])  # sees the limit two calls back, but not in its state
    assert int(state.step) == 3 and int(state.skipped_steps) == 2


def test_check_reports_a_limit_reached_by_the_last_call():
    data = batches(2)
    step = make("fused", skips=jaxdp.Skips(max_consecutive=1))
    state = step.init(Net())
    step.check(state)  # nothing skipped yet
    state, _ = step(state, poisoned(data[0], 0, 0))
    with pytest.raises(jaxdp.NonFiniteError, match=r"1 optimizer steps in a row.*=1.*step 0"):
        step.check(state)


@pytest.mark.parametrize(("path", "spelling"), [("fused", "cpu"), ("multisteps", "plain")])
def test_skip_nonfinite_false_lets_nan_through(path, spelling):
    data = batches(1)
    step = make(path, spelling=spelling, skips=jaxdp.Skips(nonfinite=False))
    state, history = run(step, [poisoned(data[0], 1, 0)])
    assert not any(bool(m["skipped"]) for m in history) and int(state.step) == 1
    assert np.isnan(np.asarray(state.params["fc"]["kernel"][...])).all()

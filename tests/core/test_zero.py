"""ZeRO stages 1 and 2 on the data axis: the same updates as stage 0, the optimizer state
split over the devices, and the collectives read from the compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import mlp_params, mse_loss, regression_data, train

import jaxdp
from jaxdp.testing import TOLERANCES, assert_trees_close

GLOBAL_BATCH, STEPS, MICRO = 24, 3, 2
OPTIMIZERS = {
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "sgd_nesterov_wd": lambda: optax.chain(
        optax.add_decayed_weights(1e-2), optax.sgd(0.05, momentum=0.9, nesterov=True)
    ),
    # max_norm below the MLP's gradient norms (about 1), so the clip acts on every step.
    "adamw_clip": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=1e-2)
    ),
}


def batches():
    x, y = regression_data(GLOBAL_BATCH * STEPS)
    return [(x[i::STEPS], y[i::STEPS]) for i in range(STEPS)]


def make(stage, num_devices=4, accum_steps=2, path="fused", optimizer="adamw_clip", **kw):
    return jaxdp.make_train_step(
        mse_loss,
        OPTIMIZERS[optimizer](),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        path=path,
        parallel=jaxdp.Parallel(zero_stage=stage, **kw.pop("parallel", {})),
        **kw,
    )


def one_call(step):
    rows = step.num_devices * MICRO * (step.accum_steps if step.path == "fused" else 1)
    return regression_data(rows)


def per_device_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


# mlp_params on 4 devices: w0 (8, 16), b0 (16,) and w1 (16, 3) split along their first
# dimension (192 elements: 48 per device); b1 (3,) kept whole, 4 does not divide 3.
SPLIT, WHOLE = 8 * 16 + 16 + 16 * 3, 3


def kinds(compiled):
    found = {}
    for c in jaxdp.testing.collectives(compiled):
        assert isinstance(c, jaxdp.testing.Collective)
        found.setdefault(c.kind, []).append(c)
    return found


# That stages 1 and 2 train as one device on the big batch (every optimizer here and the
# ones that read more than an element, both paths, one device and several, the weighted
# loss) is a part of the one equivalence grid, tests/core/test_equivalence.py.


def test_stage_1_optimizer_state_is_a_quarter_per_device():
    """AdamW's two moments: a quarter of the split leaves' bytes each per device on 4
    devices, plus the leaves kept whole (b1); every leaf in its own shape."""
    params = mlp_params()
    full = make(0).init(params)
    sharded = make(1).init(params)
    assert SPLIT + WHOLE == 195
    assert per_device_bytes(full.opt_state) == 2 * 8 * 195 + 4  # mu, nu; Adam's count
    assert per_device_bytes(sharded.opt_state) == 2 * 8 * (SPLIT // 4 + WHOLE) + 4
    shapes = jax.tree.map(np.shape, full.opt_state)
    assert jax.tree.map(np.shape, sharded.opt_state) == shapes
    assert sharded.opt_state[1][0].mu["w0"].sharding.spec == jax.sharding.PartitionSpec("data")
    multi = make(2, path="multisteps").init(params)
    # Stage 2: the gradient sums too: each device its block of the split leaves' global
    # sums, and its own [1, 3] row of b1's.
    assert per_device_bytes(multi.window.grads) == 8 * (SPLIT // 4 + WHOLE)
    # XLA's memory analysis of the compiled step agrees: its per-device arguments
    # shrink by the moments' three quarters of the split leaves, nothing else.
    memory = [
        jaxdp.plan.compiled_memory(make(s).compile(state, one_call(make(s))))
        for s, state in ((0, full), (1, sharded))
    ]
    saved = per_device_bytes(full.opt_state) - per_device_bytes(sharded.opt_state)
    assert memory[0].arguments - memory[1].arguments == saved == 2 * 8 * SPLIT * 3 // 4


# K = 1 (no loop) and K = 4 (a loop of micro-batches): the kinds of K (was 1, 2 and 4;
# the multisteps test below takes K = 3).
@pytest.mark.parametrize("accum_steps", [1, 4])
def test_stage_1_sends_one_reduce_scatter_and_one_all_gather(accum_steps):
    step = make(1, accum_steps=accum_steps)
    found = kinds(step.compile(step.init(mlp_params()), one_call(step)))
    (scatter,), (gather,) = found["reduce-scatter"], found["all-gather"]
    grads = 8 * SPLIT
    assert scatter.bytes == gather.bytes == grads
    assert scatter.executions == (1, 1) and not scatter.in_loop
    assert gather.executions[1] == 1  # in the applied update's branch
    # Together, what one ring all-reduce of the gradients sends: 2 (n-1)/n of them.
    assert scatter.ring_bytes + gather.ring_bytes == 2 * 3 / 4 * grads
    # The rest: the leaf kept whole with the loss and weight sums and the blocks' sum
    # of squares (one all-reduce), and the scalars of the clip's norm (XLA's).
    assert all(r.bytes <= 8 * (WHOLE + 3) for r in found["all-reduce"]), (
        jaxdp.testing.format_report(
            jaxdp.testing.collectives(step.compile(step.init(mlp_params()), one_call(step)))
        )
    )


@pytest.mark.parametrize("accum_steps", [1, 4])
def test_stage_2_reduce_scatters_every_micro_batch(accum_steps):
    step = make(2, accum_steps=accum_steps)
    found = kinds(step.compile(step.init(mlp_params()), one_call(step)))
    (scatter,), (gather,) = found["reduce-scatter"], found["all-gather"]
    assert scatter.executions == (accum_steps, accum_steps)
    assert scatter.bytes == gather.bytes == 8 * SPLIT
    assert gather.executions[1] == 1 and not gather.in_loop


@pytest.mark.parametrize("stage", [1, 2])
def test_multisteps_communicates_as_the_fused_path(stage):
    """Stage 1: nothing on a call that does not emit; stage 2: a reduce-scatter per call."""
    step = make(stage, path="multisteps", accum_steps=3)
    found = kinds(step.compile(step.init(mlp_params()), one_call(step)))
    (scatter,), (gather,) = found["reduce-scatter"], found["all-gather"]
    assert gather.in_conditional and gather.executions == (0, 1)
    assert scatter.in_conditional == (stage == 1)
    assert scatter.executions == ((0, 1) if stage == 1 else (1, 1))
    assert all(r.in_conditional and r.bytes <= 8 * (WHOLE + 3) for r in found["all-reduce"])


def test_bf16_communication_halves_the_bytes_and_stays_close():
    """float32 parameters; the gradient sums travel in bfloat16 (8 bits of mantissa, a
    relative rounding of at most 2**-9 per element), so after 3 SGD steps the weights'
    movement from their start agrees with the exact run's to 2% (measured at most 0.26%)."""
    params = mlp_params(dtype=np.float32)
    x, y = regression_data(GLOBAL_BATCH * STEPS, dtype=np.float32)
    data = [(x[i::STEPS], y[i::STEPS]) for i in range(STEPS)]
    exact, _ = train(make(0, optimizer="sgd_momentum"), params, data)
    step = make(1, optimizer="sgd_momentum", parallel={"comm_dtype": "bfloat16"})
    state, _ = train(step, params, data)
    leaves = (jax.tree.leaves(t) for t in (state.params, exact.params, params))
    for a, b, p in zip(*leaves, strict=True):
        moved = np.asarray(b) - p
        assert np.max(np.abs(np.asarray(a) - b)) <= 0.02 * np.max(np.abs(moved))
        assert not np.array_equal(np.asarray(a), np.asarray(b))  # bf16 did round
    # The program jaxdp hands XLA. XLA:CPU then promotes bfloat16 reductions to
    # float32 in its own passes (no bf16 adds on CPU); NCCL reduces bfloat16 as is.
    (scatter,) = kinds(step.lower(state, one_call(step)).compiler_ir("hlo").as_hlo_text())[
        "reduce-scatter"
    ]
    assert scatter.shapes[0].startswith("bf16[")
    assert scatter.bytes == 2 * SPLIT  # float32 would be 4 bytes
    step = make(0, optimizer="sgd_momentum", parallel={"comm_dtype": "bfloat16"})
    state = step.init(params)
    found = kinds(step.lower(state, one_call(step)).compiler_ir("hlo").as_hlo_text())
    wide = [r for r in found["all-reduce"] if r.shapes != ("f32[]",)]
    assert {s[:5] for r in wide for s in r.shapes} == {"bf16["}
    assert sum(r.bytes for r in wide) == 2 * sum(np.size(p) for p in jax.tree.leaves(params))


def test_frozen_leaves_and_nonfinite_skip_at_stage_2():
    # One device at the split stages (one shard): test_equivalence.py's grid.
    step = make(2, trainable={"b0": True, "b1": False, "w0": True, "w1": False})
    state = step.init(mlp_params())
    assert state.opt_state[1][0].mu["w1"] == optax.MaskedNode()
    x, y = one_call(step)
    state, metrics = step(state, (x, y))
    np.testing.assert_array_equal(state.params["w1"], mlp_params()["w1"])
    assert not np.array_equal(state.params["w0"], mlp_params()["w0"])
    before = jax.device_get(state.params)
    state, metrics = step(state, (np.where(np.arange(len(x))[:, None] == 3, np.nan, x), y))
    assert bool(metrics["skipped"]) and not bool(metrics["finite"])
    assert_trees_close(state.params, before, rtol=0, atol=0.0)


class TinyBatchNorm(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.inp = nnx.Linear(8, 4, param_dtype=jnp.float64, rngs=rngs)
        self.norm = jaxdp.models.BatchNorm(4, param_dtype=jnp.float64)
        self.out = nnx.Linear(4, 3, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.norm(self.inp(x))))


def batch_norm_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def test_local_batch_statistics_at_stage_1():
    """Device 0's running statistics ride in the scalar psum, as at stage 0 (float64,
    RTOL 1e-12). The weighted loss at every stage: test_equivalence.py's grid."""
    x, y = regression_data(GLOBAL_BATCH)
    results = []
    for stage in (0, 1):
        step = jaxdp.make_train_step(
            batch_norm_loss,
            OPTIMIZERS["adamw_clip"](),
            mesh=jaxdp.data_mesh(4),
            accum_steps=3,
            batch_stats="local",
            parallel=jaxdp.Parallel(zero_stage=stage),
        )
        state, metrics = step(step.init(TinyBatchNorm()), (x, y))
        stats = nnx.state(step.model(state), nnx.BatchStat)
        results.append((state.params, stats, float(metrics["loss"])))
    (p0, s0, l0), (p1, s1, l1) = results
    assert_trees_close(p1, p0, rtol=TOLERANCES["float64"].rtol, atol=TOLERANCES["float64"].atol)
    assert_trees_close(s1, s0, rtol=TOLERANCES["float64"].rtol, atol=TOLERANCES["float64"].atol)
    fresh = jax.tree.leaves(nnx.state(TinyBatchNorm(), nnx.BatchStat))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s1), fresh, strict=True))
    assert l1 == pytest.approx(l0, rel=TOLERANCES["float64"].rtol)


def test_bad_zero_options_are_refused_naming_them():
    mesh = jaxdp.data_mesh(2)
    for kw, match in [
        ({"zero_stage": 4}, "zero_stage=4 must be 0, 1, 2 or 3"),
        ({"zero_stage": 1, "strategy": "pmap"}, "needs strategy='shard_map'"),
        ({"comm_dtype": "float16"}, "comm_dtype='float16' must be None"),
        ({"remat": "none"}, r"remat='none' must be 'dots' \(the matrix products' outputs"),
        ({"remat": "full"}, r"remat='full' needs zero_stage=3"),
        ({"bucket_cap_mb": 0}, r"bucket_cap_mb=0 must be a positive number of MiB"),
        ({"bucket_cap_mb": True}, r"bucket_cap_mb=True must be a positive number"),
        ({"bucket_cap_mb": float("inf")}, r"bucket_cap_mb=inf must be a positive number"),
        ({"bucket_cap_mb": 1e13}, r"bucket_cap_mb=10000000000000.0 must be .* MiB below 2\*\*43"),
    ]:
        with pytest.raises(ValueError, match=match):
            jaxdp.make_train_step(
                mse_loss, optax.sgd(0.1), mesh=mesh, parallel=jaxdp.Parallel(**kw)
            )


def test_a_cpu_step_carries_no_compiler_option_of_its_own():
    """XLA:CPU sends the window in one collective: the bucket cap, XLA:GPU's combine
    threshold, is no option of a CPU step's program (tests/gpu compiles the GPU one)."""
    parallel = jaxdp.Parallel(zero_stage=1, bucket_cap_mb=8)
    step = jaxdp.make_train_step(
        mse_loss, optax.sgd(0.1), mesh=jaxdp.data_mesh(4), parallel=parallel
    )
    assert step.options.compiler_options() == {}


def test_skip_unused_at_stage_2_as_at_stage_0():
    """A parameter no micro-batch uses takes no step at any stage: the check of its
    all-reduced gradient reads the whole leaf (XLA's scalar sum over the blocks)."""

    def unused_w1(params, batch):
        x, y = batch
        return jnp.mean((jnp.tanh(x @ params["w0"] + params["b0"])[:, :3] - y) ** 2)

    results = []
    for stage in (0, 2):
        step = jaxdp.make_train_step(
            unused_w1,
            optax.sgd(0.1, momentum=0.9),
            mesh=jaxdp.data_mesh(4),
            accum_steps=2,
            parallel=jaxdp.Parallel(zero_stage=stage),
            skips=jaxdp.Skips(unused=True),
        )
        state, _ = train(step, mlp_params(), batches())
        results.append(state)
    np.testing.assert_array_equal(results[1].params["w1"], mlp_params()["w1"])
    assert_trees_close(
        results[1].params,
        results[0].params,
        rtol=TOLERANCES["float64"].rtol,
        atol=TOLERANCES["float64"].atol,
    )

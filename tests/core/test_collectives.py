"""Acceptance 3: one all-reduce of the gradients per optimizer step, whatever K."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import mlp_params, mse_loss, regression_data

import jaxdp

NUM_DEVICES, MICRO = 4, 2


def gradient_bytes(params) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))


def compiled_step(path, strategy, accum_steps, params):
    step = jaxdp.make_train_step(
        mse_loss,
        optax.adamw(1e-3),
        mesh=jaxdp.data_mesh(NUM_DEVICES),
        accum_steps=accum_steps,
        path=path,
        parallel=jaxdp.Parallel(strategy=strategy),
    )
    state = step.init(params)
    rows = NUM_DEVICES * MICRO * (accum_steps if path == "fused" else 1)
    return step, state, regression_data(rows)


# Every K under shard_map; under pmap the two that differ in kind, no accumulation (no
# loop, no branch) and the most micro-batches (was every K under both: the reduction is
# the step's own under either strategy, pmap changes how the per-device program is mapped).
LAYOUTS = [(k, "shard_map") for k in (1, 2, 4, 8)] + [(k, "pmap") for k in (1, 8)]


@pytest.mark.parametrize(("accum_steps", "strategy"), LAYOUTS)
def test_fused_path_reduces_once_per_step(accum_steps, strategy):
    params = mlp_params()
    step, state, batch = compiled_step("fused", strategy, accum_steps, params)
    reduces = jaxdp.testing.all_reduces(step.compile(state, batch))
    assert len(reduces) == 1, jaxdp.testing.format_report(reduces)
    (reduce,) = reduces
    assert reduce.executions == (1, 1)
    assert not reduce.in_loop and not reduce.in_conditional
    # Gradients plus the loss and weight sums (two float64 scalars), one payload.
    assert reduce.bytes == gradient_bytes(params) + 2 * 8
    # The report names it (was test_report_names_each_all_reduce, the 2-shard_map cell).
    text = jaxdp.testing.format_report(reduces)
    assert "top level" in text and f"{gradient_bytes(params) + 16:,}" in text


@pytest.mark.parametrize(("accum_steps", "strategy"), LAYOUTS)
def test_multisteps_path_reduces_only_on_the_emitting_call(accum_steps, strategy):
    params = mlp_params()
    step, state, batch = compiled_step("multisteps", strategy, accum_steps, params)
    reduces = jaxdp.testing.all_reduces(step.compile(state, batch))
    assert len(reduces) == 1, jaxdp.testing.format_report(reduces)
    (reduce,) = reduces
    assert reduce.bytes == gradient_bytes(params) + 2 * 8
    assert not reduce.in_loop
    if accum_steps == 1:  # every call emits: no branch around it
        assert not reduce.in_conditional and reduce.executions == (1, 1)
    else:
        # Inside a conditional: at most once per call, and only on the branch taken
        # when the replicated predicate says this call emits the update...
        assert reduce.in_conditional and reduce.executions == (0, 1)
    # ... which is exactly one call in every accum_steps.
    emitted = []
    for _ in range(2 * accum_steps):
        state, metrics = step(state, batch)
        emitted.append(bool(metrics["emitted"]))
    assert emitted == ([False] * (accum_steps - 1) + [True]) * 2
    assert int(state.step) == 2


def test_inspection_counts_the_per_micro_batch_trap():
    """A naive shard_map step (replicated params, no pcast) all-reduces inside the
    scan: the inspection reports K executions of it per call."""
    accum_steps = 4
    mesh = jaxdp.data_mesh(NUM_DEVICES)
    params = jax.tree.map(jnp.asarray, mlp_params())

    def local(params, batch):
        micro = jax.tree.map(lambda x: x.reshape(accum_steps, -1, *x.shape[1:]), batch)

        def body(acc, mb):
            return jax.tree.map(jnp.add, acc, jax.grad(mse_loss)(params, mb)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, _ = jax.lax.scan(body, zeros, micro)
        return grads

    naive = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    batch = jax.device_put(
        regression_data(NUM_DEVICES * accum_steps * MICRO), NamedSharding(mesh, P("data"))
    )
    reduces = jaxdp.testing.all_reduces(naive.lower(params, batch).compile())
    per_call = sum(r.executions[1] * r.bytes for r in reduces)
    assert all(r.in_loop for r in reduces)
    assert per_call == accum_steps * gradient_bytes(params)


def cnn_bn_step(batch_stats, path, accum_steps=2):
    model = jaxdp.models.build_model("cnn_bn", param_dtype=jnp.float64)
    step = jaxdp.make_train_step(
        jaxdp.models.model_loss("cnn_bn"),
        optax.sgd(0.1),
        mesh=jaxdp.data_mesh(NUM_DEVICES),
        accum_steps=accum_steps,
        path=path,
        batch_stats=batch_stats,
    )
    rows = NUM_DEVICES * MICRO * (accum_steps if path == "fused" else 1)
    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(rows, 8, 8, 1)), rng.integers(0, 10, size=rows))
    params = nnx.state(model, nnx.Param)
    stats = nnx.state(model, nnx.BatchStat)
    return step, step.init(model), batch, gradient_bytes(params), len(jax.tree.leaves(stats))


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_local_batch_statistics_ride_in_the_one_all_reduce(path):
    step, state, batch, grad_bytes, stats = cnn_bn_step("local", path)
    reduces = jaxdp.testing.all_reduces(step.compile(state, batch))
    assert len(reduces) == 1, jaxdp.testing.format_report(reduces)
    (reduce,) = reduces
    # Device 0's running mean and variance (8 + 16 channels) and two counters,
    # all as float64, next to the gradients and the loss and weight sums.
    assert stats == 6
    assert reduce.bytes == grad_bytes + 2 * 8 + (2 * (8 + 16) + 2) * 8
    assert not reduce.in_loop


def test_sync_batch_statistics_cost_collectives_in_every_micro_batch():
    """SyncBatchNorm's price, as in torch: per BatchNorm layer and micro-batch, channel-wide
    all-reduces in the forward (the mean, then the variance around it) and the backward."""
    accum_steps = 3
    step, state, batch, grad_bytes, _ = cnn_bn_step("sync", "fused", accum_steps)
    reduces = jaxdp.testing.all_reduces(step.compile(state, batch))
    top = [r for r in reduces if not r.in_loop]
    assert len(top) == 1 and top[0].bytes == grad_bytes + 2 * 8 + 50 * 8
    in_loop = [r for r in reduces if r.in_loop]
    assert in_loop and all(r.executions == (accum_steps, accum_steps) for r in in_loop)
    # Per layer 2 in the forward and their transposes in the backward (3 with jax
    # 0.10.2 on CPU: how XLA groups the backward's reductions is its choice).
    vectors, rest = divmod(sum(r.bytes for r in in_loop) // 8, 8 + 16)
    assert rest == 0 and 4 <= vectors <= 6, jaxdp.testing.format_report(reduces)


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        ("{{0,2},{1,3}}", {(0, 2), (1, 3)}),
        ("[2,2]<=[4]", {(0, 1), (2, 3)}),
        ("[2,2]<=[2,2]T(1,0)", {(0, 2), (1, 3)}),
        ("mesh['data'=2,'model'=2] {'data'}", {(0, 2), (1, 3)}),
        ("mesh['a'=1,'b'=2,'c'=2], device_ids=([2,2]T(1,0)) {'c'}", {(0, 2), (1, 3)}),
    ],
)
def test_a_collectives_groups_are_read_from_each_of_xlas_spellings(groups, expected):
    """``Collective.groups``: the device ids of each replica group, listed, in XLA's iota
    form (reshaped, transposed) or jax 0.12's mesh form (its axes, its device order)."""
    hlo = (
        "HloModule m\n\nENTRY %main (p: f32[4]) -> f32[4] {\n  %p = f32[4]{0} parameter(0)\n"
        f"  ROOT %all-reduce.1 = f32[4]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups},"
        " use_global_device_ids=true, to_apply=%add\n}\n"
    )
    (found,) = jaxdp.testing.collectives(hlo)
    assert found.groups == expected and found.devices == 2

"""Batch statistics through the step: device 0's chain ("local") or global ("sync")."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdp
from jaxdp.testing import TOLERANCES

pytestmark = pytest.mark.filterwarnings(
    # nnx.BatchNorm updates its float32 statistics from float64 inputs (flax's own cast).
    "ignore:scatter inputs have incompatible types:FutureWarning"
)

NUM_DEVICES, ACCUM, MICRO = 4, 2, 4
# nnx.BatchNorm keeps its running statistics in float32 whatever param_dtype (flax 0.12.8).
STATS = dict(rtol=TOLERANCES["float32"].rtol, atol=TOLERANCES["float32"].atol)


class Normalized(nnx.Module):
    """BatchNorm straight on the inputs: its statistics do not depend on the weights."""

    def __init__(self, axis_name=None):
        self.bn = nnx.BatchNorm(
            3,
            momentum=0.9,
            use_fast_variance=False,
            axis_name=axis_name,
            param_dtype=jnp.float64,
            rngs=nnx.Rngs(0),
        )
        self.out = nnx.Linear(3, 1, param_dtype=jnp.float64, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.out(self.bn(x))


def mse(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def data(rows=NUM_DEVICES * ACCUM * MICRO, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(loc=[0.0, 2.0, -1.0], scale=[1.0, 3.0, 0.5], size=(rows, 3))
    return x, x.sum(axis=1, keepdims=True)


def micro(x, device, j):
    """Rows of device ``device``'s micro-batch ``j`` (jaxdp's device-major layout)."""
    start = (device * ACCUM + j) * MICRO
    return x[start : start + MICRO]


def expected_stats(x, mode, weights=(1, 1)):
    """flax's running statistics (momentum 0.9, biased variance) after one step."""
    mean, var = np.zeros(3), np.ones(3)
    for j, w in enumerate(weights):
        if not w:
            continue
        if mode == "local":
            rows = micro(x, 0, j)
        else:
            rows = np.concatenate([micro(x, r, j) for r in range(NUM_DEVICES)])
        mean = 0.9 * mean + 0.1 * rows.mean(axis=0)
        var = 0.9 * var + 0.1 * rows.var(axis=0)
    return mean, var


def run(mode, path, strategy, x, weights=None):
    step = jaxdp.make_train_step(
        mse,
        optax.sgd(0.1),
        mesh=jaxdp.data_mesh(NUM_DEVICES),
        accum_steps=ACCUM,
        path=path,
        batch_stats=mode,
        parallel=jaxdp.Parallel(strategy=strategy),
    )
    state = step.init(Normalized())
    batch = (x, x.sum(axis=1, keepdims=True))
    if path == "fused":
        return step, step(state, batch, weights)
    sizes = jaxdp.batch_sizes(num_devices=NUM_DEVICES, accum_steps=ACCUM, micro_batch_size=MICRO)
    for call, w in zip(jaxdp.micro_batches(batch, sizes), weights or (1, 1), strict=True):
        state, metrics = step(state, call, w)
    return step, (state, metrics)


@pytest.mark.parametrize(
    "mode, path, strategy",
    [
        ("local", "fused", "shard_map"),
        ("local", "multisteps", "pmap"),
        ("sync", "fused", "pmap"),
        ("sync", "multisteps", "shard_map"),
    ],
)
def test_running_statistics_follow_device_0_or_the_global_micro_batches(mode, path, strategy):
    x, _ = data()
    step, (state, _) = run(mode, path, strategy, x)
    mean, var = expected_stats(x, mode)
    bn = step.model(state).bn
    np.testing.assert_allclose(bn.mean[...], mean, **STATS)
    np.testing.assert_allclose(bn.var[...], var, **STATS)
    # The module comes back as built: its statistics are not tied to a mesh axis.
    assert bn.axis_name is None


def test_sync_mode_equals_one_device_with_each_global_micro_batch():
    """Synchronized statistics: N devices x micro-batch b == 1 device x micro-batch N*b."""
    x, y = data()
    order = np.concatenate(
        [micro(np.arange(len(x)), r, j) for j in range(ACCUM) for r in range(NUM_DEVICES)]
    )
    states = []
    for devices, rows in ((NUM_DEVICES, np.arange(len(x))), (1, order)):
        step = jaxdp.make_train_step(
            mse,
            optax.adam(1e-2),
            mesh=jaxdp.data_mesh(devices),
            accum_steps=ACCUM,
            batch_stats="sync",
        )
        state = step.init(Normalized())
        for _ in range(3):
            state, _ = step(state, (x[rows], y[rows]))
        states.append(nnx.state(step.model(state)))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=TOLERANCES["float64"].rtol), *states
    )


def test_padding_micro_batch_leaves_statistics_alone():
    x, _ = data()
    step, (state, _) = run("local", "fused", "shard_map", x, weights=[1, 0])
    mean, var = expected_stats(x, "local", weights=(1, 0))
    np.testing.assert_allclose(step.model(state).bn.mean[...], mean, **STATS)
    np.testing.assert_allclose(step.model(state).bn.var[...], var, **STATS)


def test_eval_mode_normalizes_with_the_running_statistics():
    x, _ = data()
    step, (state, _) = run("local", "fused", "shard_map", x)
    model = step.model(state)
    model.eval()
    mean, var = expected_stats(x, "local")
    bn = model.bn
    expected = (x - mean) / np.sqrt(var + bn.epsilon) * bn.scale[...] + bn.bias[...]
    np.testing.assert_allclose(bn(jnp.asarray(x)), expected, **STATS)


def test_model_with_batch_norm_needs_an_explicit_mode():
    step = jaxdp.make_train_step(mse, optax.sgd(0.1), mesh=jaxdp.data_mesh(2))
    with pytest.raises(ValueError, match=r"bn.*choose batch_stats='local'.*or batch_stats='sync'"):
        step.init(Normalized())


def test_local_mode_refuses_a_module_already_synchronized():
    step = jaxdp.make_train_step(mse, optax.sgd(0.1), mesh=jaxdp.data_mesh(2), batch_stats="local")
    with pytest.raises(ValueError, match="bn has axis_name='data'.*batch_stats='local'"):
        step.init(Normalized(axis_name="data"))


def test_mode_without_batch_norm_is_refused():
    step = jaxdp.make_train_step(
        lambda p, b: jnp.sum(p["w"]), optax.sgd(0.1), mesh=jaxdp.data_mesh(2), batch_stats="sync"
    )
    with pytest.raises(ValueError, match="batch_stats='sync' but the model has no module"):
        step.init({"w": np.ones(2)})


def test_writing_a_constant_variable_is_an_error():
    class Counter(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))
            self.calls = nnx.Variable(jnp.zeros([]))

        def __call__(self, x):
            self.calls[...] = self.calls[...] + 1
            return x @ self.w[...]

    step = jaxdp.make_train_step(
        lambda m, b: jnp.mean(m(b)), optax.sgd(0.1), mesh=jaxdp.data_mesh(2)
    )
    state = step.init(Counter())
    with pytest.raises(TypeError, match="wrote the model variable calls.*nnx.BatchStat"):
        step(state, np.ones((4, 2)))

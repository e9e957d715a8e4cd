"""Models as users write them (issue 26, items 2 and 3): a bound Flax Linen module trains
exactly as its NNX twin, BatchNorm and dropout included; flax's nnx.bridge path takes
batch_stats; an equinox module trains as its pytree twin; what would train silently
wrong is refused."""

import equinox as eqx
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxdp
from jaxdp.testing import TOLERANCES, assert_trees_close

TOL = {"rtol": TOLERANCES["float64"].rtol, "atol": TOLERANCES["float64"].atol}
F64 = {"param_dtype": jnp.float64, "dtype": jnp.float64}


class LinenNet(nn.Module):
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(6, **F64)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8, **F64)(x)
        x = nn.Dropout(self.dropout, deterministic=not train)(jax.nn.relu(x))
        return nn.Dense(2, **F64)(x)


class NNXNet(nnx.Module):  # the twin: the same layers under Linen's names
    def __init__(self, rngs):
        self.Dense_0 = nnx.Linear(5, 6, rngs=rngs, **F64)
        self.BatchNorm_0 = nnx.BatchNorm(6, momentum=0.8, rngs=rngs, **F64)
        self.Dense_1 = nnx.Linear(6, 2, rngs=rngs, **F64)

    def __call__(self, x):
        return self.Dense_1(jax.nn.relu(self.BatchNorm_0(self.Dense_0(x))))


def data(rows=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, 5)), rng.normal(size=(rows, 2))


def linen_variables(model=None):
    return (model or LinenNet()).init({"params": jax.random.key(0)}, jnp.ones((2, 5)), train=False)


def nnx_twin(variables):
    twin = NNXNet(nnx.Rngs(0))
    for collection in ("params", "batch_stats"):
        for path, value in jax.tree_util.tree_flatten_with_path(variables[collection])[0]:
            layer, leaf = (k.key for k in path)
            getattr(getattr(twin, layer), leaf).set_value(jnp.asarray(value, jnp.float64))
    return twin


def mse(model, batch):
    x, y = batch
    out = model(x, train=True) if isinstance(model, nn.Module) else model(x)
    return jnp.mean((out - y) ** 2)


def train(model, mode, path, steps=3, loss=mse, **kw):
    """``steps`` optimizer steps of 16 rows, 4 devices x 2 micro-batches; the step and state."""
    step = jaxdp.make_train_step(
        loss,
        optax.adamw(0.05, weight_decay=0.1),
        mesh=jaxdp.data_mesh(4),
        accum_steps=2,
        path=path,
        batch_stats=mode,
        **kw,
    )
    x, y = data()
    state = step.init(model)
    for s in range(steps):
        batch = (x[s::steps][:16], y[s::steps][:16])
        calls = [batch]
        if path == "multisteps":
            calls = [(batch[0][:8], batch[1][:8]), (batch[0][8:], batch[1][8:])]
        for call in calls:
            state, _ = step(state, call)
    return step, state


# Each mode once and each path once (was every mode x path, 4 cells): what is Linen's
# own, the binding, the collections read in and written back, is the same in every cell;
# every mode x path of the BatchNorm itself is tests/core/test_batch_norm.py's.
@pytest.mark.parametrize(("mode", "path"), [("local", "multisteps"), ("sync", "fused")])
def test_a_bound_linen_module_trains_as_its_nnx_twin(mode, path):
    variables = linen_variables()
    step, state = train(LinenNet().bind(variables), mode, path)
    twin_step, twin_state = train(nnx_twin(variables), mode, path)
    trained, twin = step.model(state), twin_step.model(twin_state)
    assert isinstance(trained, LinenNet) and trained.scope is not None
    _, got = trained.unbind()
    want = nnx_twin(got)  # the Linen values under the twin's names
    assert_trees_close(nnx.state(want, nnx.Param), nnx.state(twin, nnx.Param), **TOL)
    assert_trees_close(nnx.state(want, nnx.BatchStat), nnx.state(twin, nnx.BatchStat), **TOL)
    # The running statistics moved (the Linen issue: they never did) and did not train.
    var = got["batch_stats"]["BatchNorm_0"]["var"]
    assert not np.allclose(var, 1.0) and "var" not in got["params"]["BatchNorm_0"]


def test_linen_dropout_draws_from_jaxdp_streams_per_device_and_micro_batch():
    variables = linen_variables(LinenNet(dropout=0.5))
    x, y = data(rows=4)
    same = (np.tile(x, (8, 1)), np.tile(y, (8, 1)))  # one micro-batch on every device, twice

    def run(key, devices, accum):
        step = jaxdp.make_train_step(
            mse,
            optax.sgd(0.1),
            mesh=jaxdp.data_mesh(devices),
            accum_steps=accum,
            batch_stats="local",
        )
        bound = LinenNet(dropout=0.5).bind(variables, rngs={"dropout": jax.random.key(key)})
        state, _ = step(step.init(bound), jax.tree.map(lambda a: a[: 4 * devices * accum], same))
        return state.params

    once = run(1, 1, 1)
    everywhere = run(1, 4, 2)
    assert_trees_close(run(1, 4, 2), everywhere, rtol=0, atol=0)  # reproducible
    # With one mask for all 8 copies the update would equal the single copy's.
    assert not np.allclose(
        everywhere["params"]["Dense_1"]["kernel"],
        once["params"]["Dense_1"]["kernel"],
    )
    assert not np.allclose(
        run(2, 4, 2)["params"]["Dense_1"]["kernel"],
        everywhere["params"]["Dense_1"]["kernel"],
    )


def test_flax_bridge_modules_take_batch_stats():
    bridged = nnx.bridge.ToNNX(LinenNet(), rngs=nnx.Rngs(0)).lazy_init(
        jnp.ones((2, 5)), train=False
    )

    def loss(model, batch):
        x, y = batch
        return jnp.mean((model(x, train=True, mutable=["batch_stats"]) - y) ** 2)

    step = jaxdp.make_train_step(loss, optax.sgd(0.1), mesh=jaxdp.data_mesh(4), batch_stats="local")
    state, _ = step(step.init(bridged), data(rows=16))
    var = step.model(state).BatchNorm_0["var"].get_value()
    assert not np.allclose(var, 1.0)


def test_what_would_train_silently_wrong_is_refused():
    variables = linen_variables()
    step = jaxdp.make_train_step(mse, optax.adamw(0.1), mesh=jaxdp.data_mesh(4))
    with pytest.raises(
        TypeError, match=r"Linen variables dict with the collections \['batch_stats'\]"
    ):
        step.init(variables)
    with pytest.raises(TypeError, match=r"unbound Flax Linen module: give step.init"):
        step.init(LinenNet())
    with pytest.raises(ValueError, match=r"the model normalizes with batch statistics"):
        step.init(LinenNet().bind(variables))
    local = jaxdp.make_train_step(mse, optax.sgd(0.1), mesh=jaxdp.data_mesh(4), batch_stats="local")

    class Synced(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            return nn.BatchNorm(use_running_average=False, axis_name="data")(x)

    synced = Synced().bind(Synced().init(jax.random.key(0), jnp.ones((2, 2))))
    with pytest.raises(
        ValueError, match=r"BatchNorm .* has axis_name='data' .* batch_stats='local'"
    ):
        local(local.init(synced), (np.ones((8, 2)), np.ones((8, 2))))


def apply_mutable(model, batch):  # Linen's own spelling of a training forward
    x, y = batch
    out, _ = model.apply(model.variables, x, train=True, mutable=["batch_stats"])
    return jnp.mean((out - y) ** 2)


def call_mutable(model, batch):
    x, y = batch
    out, _ = model(x, train=True, mutable=["batch_stats"])
    return jnp.mean((out - y) ** 2)


@pytest.mark.parametrize(
    "loss, spelling",
    [(apply_mutable, r"LinenNet.apply\(\.\.\., mutable="), (call_mutable, r"__call__\(")],
    ids=["apply", "call"],
)
def test_linen_mutable_in_loss_fn_says_what_jaxdp_does_instead(loss, spelling):
    # apply's updates would be dropped (the statistics never move); a call fails in flax.
    step = jaxdp.make_train_step(loss, optax.sgd(0.1), mesh=jaxdp.data_mesh(4), batch_stats="local")
    state = step.init(LinenNet().bind(linen_variables()))
    with pytest.raises(
        TypeError,
        match=spelling + r".*collects the updated statistics itself.*model\(x, train=True\), "
        r"without .*mutable=",
    ):
        step(state, data(rows=16))


def test_linen_dropout_bound_without_rngs_says_how_to_bind():
    variables = linen_variables(LinenNet(dropout=0.5))
    step = jaxdp.make_train_step(mse, optax.sgd(0.1), mesh=jaxdp.data_mesh(4), batch_stats="local")
    state = step.init(LinenNet(dropout=0.5).bind(variables))
    with pytest.raises(
        ValueError,
        match=r"draws from the rng stream 'dropout' but step.init got it bound with no rngs: "
        r".*module.bind\(variables, rngs=\{'dropout': key\}\)",
    ) as raised:
        step(state, data(rows=16))
    assert isinstance(raised.value.__cause__, flax.errors.InvalidRngError)


class EqxNet(eqx.Module):
    first: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    last: eqx.nn.Linear
    table: jax.Array  # an integer array: static, never trained
    act: callable = eqx.field(static=True)

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(5, 6, key=k1, dtype=jnp.float64)
        self.norm = eqx.nn.LayerNorm(6, dtype=jnp.float64)
        self.last = eqx.nn.Linear(6, 2, key=k2, dtype=jnp.float64)
        self.table = jnp.arange(3)
        self.act = jax.nn.tanh

    def __call__(self, x):
        return jax.vmap(lambda r: self.last(self.act(self.norm(self.first(r)))))(x)


def plain_forward(p, x):  # the same network on a plain pytree
    h = x @ p["w1"].T + p["b1"]
    h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
    return jnp.tanh(h * p["g"] + p["beta"]) @ p["w2"].T + p["b2"]


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_an_equinox_module_trains_as_its_pytree_twin(path):
    net = EqxNet(jax.random.key(0))
    step, state = train(net, None, path)
    plain = {
        "w1": net.first.weight,
        "b1": net.first.bias,
        "g": net.norm.weight,
        "beta": net.norm.bias,
        "w2": net.last.weight,
        "b2": net.last.bias,
    }

    def plain_mse(p, batch):
        return jnp.mean((plain_forward(p, batch[0]) - batch[1]) ** 2)

    twin = train(plain, None, path, loss=plain_mse)[1]
    trained = step.model(state)
    assert isinstance(trained, EqxNet) and trained.act is jax.nn.tanh
    got = {
        "w1": trained.first.weight,
        "b1": trained.first.bias,
        "g": trained.norm.weight,
        "beta": trained.norm.bias,
        "w2": trained.last.weight,
        "b2": trained.last.bias,
    }
    assert_trees_close(got, twin.params, **TOL)
    assert not np.allclose(got["w1"], net.first.weight)
    np.testing.assert_array_equal(trained.table, [0, 1, 2])
    assert "table" not in jax.tree_util.keystr(
        jax.tree_util.tree_flatten_with_path(state.params)[0]
    )


def test_equinox_state_is_refused_at_init_with_what_works():
    class Normed(eqx.Module):
        norm: eqx.nn.BatchNorm

    model = Normed(eqx.nn.BatchNorm(4, axis_name="batch", mode="batch"))
    step = jaxdp.make_train_step(mse, optax.sgd(0.1), mesh=jaxdp.data_mesh(4))
    with pytest.raises(TypeError, match=r"stateful layers \(eqx.nn.StateIndex at \['.norm"):
        step.init(model)
    # make_with_state's (model, state) pair: the refusal at once, not eqx.partition's advice.
    pair = eqx.nn.make_with_state(Normed)(eqx.nn.BatchNorm(4, axis_name="batch", mode="batch"))
    with pytest.raises(
        TypeError,
        match=r"equinox \(model, eqx.nn.State\) pair .*StateIndex at \['.norm.*stateless "
        r"normalization",
    ):
        step.init(pair)


def test_linen_and_equinox_states_restore_from_checkpoints(tmp_path):
    sizes = jaxdp.batch_sizes(num_devices=4, accum_steps=2, micro_batch_size=2)
    rngs = {"dropout": jax.random.key(1)}
    for name, make, mode in [
        ("linen", lambda: LinenNet(dropout=0.5).bind(linen_variables(), rngs=rngs), "local"),
        ("equinox", lambda: EqxNet(jax.random.key(0)), None),
    ]:
        step, state = train(make(), mode, "fused", steps=1)
        checkpoints = jaxdp.checkpoint.Checkpoints(tmp_path / name)
        checkpoints.save(state, position=jaxdp.SamplerPosition(0, 1), sizes=sizes, samples=16)
        restored = checkpoints.restore(step.init(make()), sizes=sizes).state
        batch = jax.tree.map(lambda a: a[:16], data(seed=1))
        (after, _), (again, _) = step(state, batch), step(restored, batch)
        assert_trees_close(again.params, after.params, rtol=0, atol=0)
        assert_trees_close(data_of(again.model_state), data_of(after.model_state), rtol=0, atol=0)


def data_of(tree):
    """rng keys as their data, to compare."""
    keys = jax.dtypes.prng_key
    return jax.tree.map(
        lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, keys) else x, tree
    )

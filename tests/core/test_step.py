"""The step compiles once, takes NNX modules, and reports its metrics."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import big_batch_reference, mlp_params, mse_loss, regression_data, train

import jaxdp
from jaxdp.testing import TOLERANCES, assert_trees_close

# HSDP: the state init() places must be what the step returns, on its two-axis mesh (it
# was on the data mesh, and the second call compiled the step again).
HSDP = {"zero_stage": 3, "shards": 2}
ONCE = [
    (path, strategy, layout)
    for path in ("fused", "multisteps")
    for strategy, layout in [("shard_map", {}), ("pmap", {}), ("shard_map", HSDP)]
]


@pytest.mark.parametrize(
    ("path", "strategy", "layout"),
    ONCE,
    ids=[f"{p}-{s}{'-hsdp' if lay else ''}" for p, s, lay in ONCE],
)
@pytest.mark.filterwarnings(r"ignore:Parallel\(zero_stage=3\)")  # the MLP has no stack
def test_compiled_once_over_steps(path, strategy, layout):
    traces = []

    def counting_loss(params, batch):
        traces.append(1)  # runs only while JAX traces
        return mse_loss(params, batch)

    step = jaxdp.make_train_step(
        counting_loss,
        optax.adamw(1e-3),
        mesh=jaxdp.data_mesh(4),
        accum_steps=2,
        path=path,
        parallel=jaxdp.Parallel(strategy=strategy, **layout),
    )
    rows = 16 if path == "fused" else 8
    state = step.init(mlp_params())
    for i in range(6):
        state, _ = step(state, regression_data(rows, seed=i))
    traced_once = len(traces)
    (program,) = step._programs.values()  # on CPU: one set of compiler options
    assert program._cache_size() == 1
    for i in range(3):
        state, _ = step(state, regression_data(rows, seed=10 + i))
    assert len(traces) == traced_once
    assert program._cache_size() == 1


def test_metrics_are_big_batch_loss_grad_norm_and_learning_rate():
    schedule = optax.linear_schedule(0.1, 0.0, transition_steps=10)
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    step = jaxdp.make_train_step(mse_loss, opt, mesh=jaxdp.data_mesh(4), accum_steps=2)
    params = jax.tree.map(jnp.asarray, mlp_params())
    batch = regression_data(32)
    _, metrics = step(step.init(mlp_params()), batch)
    loss, grads = jax.value_and_grad(mse_loss)(params, batch)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=TOLERANCES["float64"].rtol)
    np.testing.assert_allclose(
        metrics["grad_norm"], optax.tree.norm(grads), rtol=TOLERANCES["float64"].rtol
    )
    # inject_hyperparams records the rate it just used: schedule(0).
    np.testing.assert_allclose(metrics["learning_rate"], 0.1)


def test_multisteps_metrics_describe_the_last_update():
    step = jaxdp.make_train_step(
        mse_loss, optax.sgd(0.1), mesh=jaxdp.data_mesh(2), accum_steps=2, path="multisteps"
    )
    params = jax.tree.map(jnp.asarray, mlp_params())
    batch = regression_data(8)
    state, history = train(step, mlp_params(), [batch])
    assert [bool(m["emitted"]) for m in history] == [False, True]
    np.testing.assert_allclose(
        history[-1]["loss"], mse_loss(params, batch), rtol=TOLERANCES["float64"].rtol
    )
    assert "learning_rate" not in history[-1]  # plain sgd holds no rate in its state


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, 16, rngs=rngs, param_dtype=jnp.float64)
        self.out = nnx.Linear(16, 3, rngs=rngs, param_dtype=jnp.float64)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def nnx_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_nnx_module_trains_like_its_parameter_pytree(path):
    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    batches = [regression_data(16, seed=s) for s in range(3)]

    def pytree_loss(p, batch):
        return nnx_loss(nnx.merge(graphdef, p), batch)

    expected = big_batch_reference(pytree_loss, optax.adam(1e-2), params, batches)
    step = jaxdp.make_train_step(
        nnx_loss, optax.adam(1e-2), mesh=jaxdp.data_mesh(4), accum_steps=2, path=path
    )
    state, _ = train(step, model, batches)
    trained = step.model(state)
    assert isinstance(trained, MLP)
    assert_trees_close(
        nnx.state(trained, nnx.Param), expected, rtol=TOLERANCES["float64"].rtol, atol=0.0
    )
    # The caller's module is left as it was.
    assert_trees_close(nnx.state(model, nnx.Param), params, rtol=0, atol=0.0)


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_donation_never_deletes_the_callers_arrays(path):
    """With one device the caller's arrays already have the step's sharding;
    init must still copy them, since the step donates its input state."""
    mesh = jaxdp.data_mesh(1)
    params = jax.device_put(
        mlp_params(), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )
    model = MLP(nnx.Rngs(0))
    kernel = np.array(model.hidden.kernel[...])
    for start, loss in ((params, mse_loss), (model, nnx_loss)):
        step = jaxdp.make_train_step(loss, optax.sgd(0.1), mesh=mesh, path=path)
        state = step.init(start)
        for _ in range(2):
            state, _ = step(state, regression_data(4))
    assert_trees_close(params, mlp_params(), rtol=0, atol=0.0)
    np.testing.assert_array_equal(model.hidden.kernel[...], kernel)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_the_model_step_model_returns_is_the_callers_own(zero_stage):
    """Weights loaded into the returned module (an EMA, zeros for a check) never reach the
    training state, and a model kept across a donated call stays readable."""
    step = jaxdp.make_train_step(
        nnx_loss,
        optax.sgd(0.1),
        mesh=jaxdp.data_mesh(4),
        accum_steps=2,
        parallel=jaxdp.Parallel(zero_stage=zero_stage),
    )
    batches = [regression_data(16, seed=s) for s in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stage 3 warns of a model without scan_layers
        state, _ = train(step, MLP(nnx.Rngs(0)), batches[:1])
    trained = jax.tree.map(np.array, nnx.state(step.model(state), nnx.Param))
    evaluated = step.model(state)
    nnx.update(evaluated, jax.tree.map(jnp.zeros_like, nnx.state(evaluated, nnx.Param)))
    assert_trees_close(nnx.state(step.model(state), nnx.Param), trained, rtol=0, atol=0.0)
    kept = step.model(state)  # kept across the next call, which donates the state
    held = jax.tree.leaves(state.params)
    padded = state.logical.params if state.logical else (None,) * len(held)
    for ours, theirs, shape in zip(
        jax.tree.leaves(nnx.state(kept, nnx.Param)), held, padded, strict=True
    ):
        if shape is None:
            assert ours.sharding.is_equivalent_to(theirs.sharding, ours.ndim)  # stage 3: split
        else:  # held padded (stage 3: the head's 3 on 4 devices): the model's own shape
            assert ours.shape == shape != theirs.shape
    state, _ = step(state, batches[1])
    assert_trees_close(nnx.state(kept, nnx.Param), trained, rtol=0, atol=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        untouched, _ = train(step, MLP(nnx.Rngs(0)), batches)
    assert_trees_close(
        state.params, untouched.params, rtol=0, atol=0.0
    )  # trained from its own weights


# ---- the state as shapes alone -------------------------------------------------------------

ABSTRACT = [(0, "fused", None), (1, "multisteps", None), (3, "multisteps", 2)]


@pytest.mark.parametrize(("stage", "path", "shards"), ABSTRACT)
def test_abstract_state_is_what_init_returns_with_nothing_allocated(stage, path, shards):
    """``step.abstract_state(model)`` has init's tree, shapes, dtypes and shardings, from an
    abstract model (``nnx.eval_shape``); the step lowers from it and an abstract batch to
    the program it lowers from the placed state and batch."""
    step = jaxdp.make_train_step(
        lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2),
        optax.adamw(1e-3),
        mesh=jaxdp.data_mesh(4),
        accum_steps=2,
        path=path,
        parallel=jaxdp.Parallel(zero_stage=stage, shards=shards),
    )
    made = step.init(jaxdp.models.Stack(rngs=nnx.Rngs(0)))
    abstract = step.abstract_state(nnx.eval_shape(lambda: jaxdp.models.Stack(rngs=nnx.Rngs(0))))
    assert jax.tree.structure(abstract) == jax.tree.structure(made)
    for a, m in zip(jax.tree.leaves(abstract), jax.tree.leaves(made), strict=True):
        assert isinstance(a, jax.ShapeDtypeStruct)
        assert (a.shape, a.dtype) == (m.shape, m.dtype)
        assert a.sharding.is_equivalent_to(m.sharding, m.ndim), (a.sharding, m.sharding)
    rows = 4 * (2 if path == "fused" else 1) * 2
    x, y = np.ones((rows, 6), np.float32), np.ones((rows, 5), np.float32)
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, y))
    assert step.lower(abstract, shapes).as_text() == step.lower(made, (x, y)).as_text()


def test_init_refuses_abstract_leaves_naming_abstract_state():
    step = jaxdp.make_train_step(mse_loss, optax.sgd(0.1), mesh=jaxdp.data_mesh(2))
    with pytest.raises(TypeError, match=r"params\['w'\] is a jax.ShapeDtypeStruct .* call "):
        step.init({"w": jax.ShapeDtypeStruct((3, 1), jnp.float32)})

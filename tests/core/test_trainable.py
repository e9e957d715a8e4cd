"""Frozen parameters (no gradient, no bytes, no optimizer state) and unused ones."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import big_batch_reference, mlp_params, mse_loss, regression_data, train

import jaxdp
from jaxdp.testing import TOLERANCES, assert_trees_close

FROZEN = {"w0": False, "b0": True, "w1": True, "b1": False}  # trainable flags
OPT = optax.adamw(1e-2, weight_decay=0.1)


def step_for(trainable, path="fused", optimizer=OPT, **kw):
    return jaxdp.make_train_step(
        mse_loss,
        optimizer,
        mesh=jaxdp.data_mesh(4),
        accum_steps=2,
        path=path,
        trainable=trainable,
        **kw,
    )


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_frozen_parameters_stay_and_the_rest_trains_like_optax_on_the_rest(path):
    params = mlp_params()
    batches = [regression_data(16, seed=s) for s in range(3)]
    state, _ = train(step_for(FROZEN, path), params, batches)
    for name, flag in FROZEN.items():
        if not flag:  # bitwise, weight decay included
            np.testing.assert_array_equal(state.params[name], params[name])
    trained = {k: v for k, v in params.items() if FROZEN[k]}
    frozen = {k: jnp.asarray(v) for k, v in params.items() if not FROZEN[k]}
    expected = big_batch_reference(lambda p, b: mse_loss({**p, **frozen}, b), OPT, trained, batches)
    assert_trees_close(
        {k: state.params[k] for k in trained}, expected, rtol=TOLERANCES["float64"].rtol, atol=0.0
    )


def test_frozen_parameters_have_no_optimizer_state():
    params = mlp_params()
    state = step_for(FROZEN).init(params)
    sizes = {np.shape(x) for x in jax.tree.leaves(state.opt_state)}
    assert np.shape(params["w0"]) not in sizes and np.shape(params["w1"]) in sizes


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_frozen_parameters_add_no_all_reduce_bytes(path):
    params = mlp_params()
    step = step_for(FROZEN, path)
    rows = 16 if path == "fused" else 8
    (reduce,) = jaxdp.testing.all_reduces(step.compile(step.init(params), regression_data(rows)))
    trainable_bytes = sum(params[k].nbytes for k, flag in FROZEN.items() if flag)
    assert reduce.bytes == trainable_bytes + 2 * 8  # + the loss and weight sums


class Embedded(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(10, 4, param_dtype=jnp.float64, rngs=rngs)
        self.out = nnx.Linear(4, 1, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, tokens):
        return self.out(self.embed(tokens).mean(axis=1))


def embedded_loss(model, batch):
    tokens, y = batch
    return jnp.mean((model(tokens) - y) ** 2)


@pytest.mark.parametrize(
    "trainable",
    [
        nnx.Not(nnx.PathContains("embed")),
        lambda path, value: path[0] != "embed",
    ],
    ids=["nnx_filter", "predicate"],
)
def test_nnx_filters_and_predicates_select_the_trainable_parameters(trainable):
    model = Embedded()
    table = np.array(model.embed.embedding[...])
    step = jaxdp.make_train_step(embedded_loss, OPT, mesh=jaxdp.data_mesh(2), trainable=trainable)
    rng = np.random.default_rng(0)
    batch = (rng.integers(0, 10, size=(8, 3)), rng.normal(size=(8, 1)))
    state, _ = step(step.init(model), batch)
    trained = step.model(state)
    np.testing.assert_array_equal(trained.embed.embedding[...], table)
    assert not np.array_equal(trained.out.kernel[...], model.out.kernel[...])


def test_trainable_tree_must_match_the_parameters():
    with pytest.raises(ValueError, match="trainable has 2 leaves but the model has 4"):
        step_for({"w0": True, "b0": False}).init(mlp_params())


def unused_loss(params, batch):
    """Uses b1 only for micro-batches whose first target is positive."""
    x, y = batch
    h = jnp.tanh(x @ params["w0"] + params["b0"]) @ params["w1"]
    h = jnp.where(y[0, 0] > 0, h + params["b1"], h)
    return jnp.mean((h - y) ** 2)


@pytest.mark.parametrize("skip", [False, True])
def test_unused_parameter_needs_no_flag_and_skip_unused_holds_it_like_torch(skip):
    step = jaxdp.make_train_step(
        unused_loss,
        optax.sgd(0.1, momentum=0.9),
        mesh=jaxdp.data_mesh(2),
        skips=jaxdp.Skips(unused=skip),
    )
    used, unused = regression_data(4, seed=0), regression_data(4, seed=0)
    used[1][::2, 0], unused[1][::2, 0] = 1.0, -1.0  # each device's first row decides
    state = step.init(mlp_params())
    state, _ = step(state, used)
    before = np.asarray(state.params["b1"])
    state, metrics = step(state, unused)  # no device uses b1: its gradient is exactly 0
    after = np.asarray(state.params["b1"])
    if skip:  # torch: .grad is None, SGD leaves the parameter and its momentum alone
        np.testing.assert_array_equal(after, before)
    else:  # optax: a zero gradient, and momentum still moves the parameter
        assert not np.allclose(after, before)
    assert not np.array_equal(state.params["w0"], mlp_params()["w0"])
    assert np.isfinite(metrics["loss"])


def test_skip_unused_keeps_momentum_of_the_unused_leaf_only():
    from jaxdp._frozen import skip_unused  # private: not imported by `import jaxdp`

    opt = skip_unused(optax.adam(0.1))
    params = {"a": jnp.ones(3), "b": jnp.ones(2)}
    state = opt.init(params)
    _, state = opt.update({"a": jnp.ones(3), "b": jnp.ones(2)}, state, params)
    _, after = opt.update({"a": jnp.ones(3), "b": jnp.zeros(2)}, state, params)
    adam, adam_after = state[0], after[0]
    np.testing.assert_array_equal(adam_after.mu["b"], adam.mu["b"])
    np.testing.assert_array_equal(adam_after.nu["b"], adam.nu["b"])
    assert not np.array_equal(adam_after.mu["a"], adam.mu["a"])
    assert (
        int(adam_after.count) == 2
    )  # shared by all leaves: it advances (torch's per-leaf would not)

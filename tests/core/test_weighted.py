"""Acceptance 2: the weighted mode is the exact global token mean; the mean mode is not."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import max_rel_diff
from models import mlp_apply, mlp_params, train

import jaxdp
from jaxdp.testing import TOLERANCES, assert_trees_close

TOKENS, FEATURES, STEPS, GLOBAL_BATCH = 6, 8, 3, 16


def token_data(seed: int = 3):
    """Rows of padded token sequences whose lengths (1..TOKENS) differ a lot."""
    rng = np.random.default_rng(seed)
    rows = GLOBAL_BATCH * STEPS
    x = rng.normal(size=(rows, TOKENS, FEATURES))
    y = rng.normal(size=(rows, TOKENS, 3))
    lengths = rng.integers(1, TOKENS + 1, size=rows)
    mask = (np.arange(TOKENS)[None, :] < lengths[:, None]).astype(np.float64)
    return [(x[i::STEPS], y[i::STEPS], mask[i::STEPS]) for i in range(STEPS)]


def token_sum_and_count(params, batch):
    x, y, mask = batch
    err = jnp.sum((mlp_apply(params, x) - y) ** 2, axis=-1)
    return jnp.sum(err * mask), jnp.sum(mask)


def token_mean(params, batch):
    total, count = token_sum_and_count(params, batch)
    return total / count


def sgd():
    return optax.sgd(0.1, momentum=0.9)


def reference(loss_of_grads, batches):
    params = jax.tree.map(jnp.asarray, mlp_params())
    opt = sgd()
    state = opt.init(params)
    for batch in batches:
        updates, state = opt.update(loss_of_grads(params, batch), state, params)
        params = optax.apply_updates(params, updates)
    return params


def global_token_mean_grads(params, batch):
    return jax.grad(token_mean)(params, batch)


# The references depend on the layout at most, not on the path or the strategy: each is
# computed once for the module (op by op, they cost more than the step they check).
@functools.cache
def exact_reference():
    """SGD on the global token mean of token_data(), one big batch."""
    return reference(global_token_mean_grads, token_data())


@functools.cache
def ddp_reference(num_devices, accum_steps):
    """SGD on the mean of the micro-batch means of token_data() in that layout."""
    return reference(mean_of_micro_batch_means_grads(num_devices, accum_steps), token_data())


def mean_of_micro_batch_means_grads(num_devices, accum_steps):
    """DDP with ``loss / accum_steps``: the mean over all micro-batches of their means."""
    sizes = jaxdp.batch_sizes(
        num_devices=num_devices, accum_steps=accum_steps, global_batch_size=GLOBAL_BATCH
    )

    def grads(params, batch):
        parts = [
            tuple(
                leaf[j * sizes.micro_batch_size : (j + 1) * sizes.micro_batch_size]
                for leaf in batch
            )
            for j in range(num_devices * accum_steps)
        ]
        per_micro = [jax.grad(token_mean)(params, part) for part in parts]
        return jax.tree.map(lambda *g: sum(g) / len(g), *per_micro)

    return grads


# The weighted mode equals the global token mean on one device on the big batch at every
# layout: test_equivalence.py's grid (its "tokens" model). Here: the mean mode is not.
LAYOUTS = [(1, 4), (2, 2), (4, 2), (2, 1)]
PATHS = ["fused", "multisteps"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("num_devices", "accum_steps"), LAYOUTS)
def test_mean_mode_is_mean_of_micro_batch_means(num_devices, accum_steps, path):
    batches = token_data()
    step = jaxdp.make_train_step(
        token_mean,
        sgd(),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        path=path,
    )
    state, _ = train(step, mlp_params(), batches)
    ddp = ddp_reference(num_devices, accum_steps)
    assert_trees_close(
        state.params, ddp, rtol=TOLERANCES["float64"].rtol, atol=TOLERANCES["float64"].atol
    )
    # ... which is NOT the global token mean when token counts differ.
    assert max_rel_diff(state.params, exact_reference()) > 1e-3


def test_weighted_loss_metric_is_global_token_mean():
    batches = token_data()
    step = jaxdp.make_train_step(
        token_sum_and_count,
        sgd(),
        mesh=jaxdp.data_mesh(4),
        accum_steps=2,
        loss_reduction="weighted",
    )
    state = step.init(mlp_params())
    _, metrics = step(state, batches[0])
    expected = token_mean(jax.tree.map(jnp.asarray, mlp_params()), batches[0])
    np.testing.assert_allclose(
        float(metrics["loss"]), float(expected), rtol=TOLERANCES["float64"].rtol
    )

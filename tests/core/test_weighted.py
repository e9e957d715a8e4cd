"""Acceptance 2: the weighted mode is the exact global token mean; the mean mode is not."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ATOL, RTOL, assert_trees_close, max_rel_diff
from models import mlp_apply, mlp_params, train

import jaxdp

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


LAYOUTS = [(1, 4), (2, 2), (4, 2), (2, 1)]
PATHS = ["fused", "multisteps"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("num_devices", "accum_steps"), LAYOUTS)
@pytest.mark.parametrize("strategy", ["shard_map", "pmap"])
def test_weighted_mode_equals_global_token_mean(num_devices, accum_steps, path, strategy):
    batches = token_data()
    step = jaxdp.make_train_step(
        token_sum_and_count,
        sgd(),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        path=path,
        loss_reduction="weighted",
        parallel=jaxdp.Parallel(strategy=strategy),
    )
    state, _ = train(step, mlp_params(), batches)
    assert_trees_close(
        state.params, reference(global_token_mean_grads, batches), rtol=RTOL["float64"]
    )


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
    ddp = reference(mean_of_micro_batch_means_grads(num_devices, accum_steps), batches)
    assert_trees_close(state.params, ddp, rtol=RTOL["float64"], atol=ATOL["float64"])
    # ... which is NOT the global token mean when token counts differ.
    exact = reference(global_token_mean_grads, batches)
    assert max_rel_diff(state.params, exact) > 1e-3


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
    np.testing.assert_allclose(float(metrics["loss"]), float(expected), rtol=RTOL["float64"])

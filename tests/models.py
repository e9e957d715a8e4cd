"""Small models, data and drivers shared by the tests."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdp

OPTIMIZERS = {
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
}


def mlp_params(seed: int = 0, sizes=(8, 16, 3), dtype=np.float64) -> dict:
    rng = np.random.default_rng(seed)
    params = {}
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        params[f"w{i}"] = (rng.normal(size=(m, n)) / np.sqrt(m)).astype(dtype)
        params[f"b{i}"] = (0.1 * rng.normal(size=n)).astype(dtype)
    return params


def mlp_apply(params: dict, x):
    layers = len(params) // 2
    for i in range(layers):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            x = jnp.tanh(x)
    return x


def mse_loss(params, batch):
    x, y = batch
    return jnp.mean((mlp_apply(params, x) - y) ** 2)


def regression_data(rows: int, seed: int = 1, sizes=(8, 16, 3), dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, sizes[0])).astype(dtype)
    return x, rng.normal(size=(rows, sizes[-1])).astype(dtype)


def big_batch_reference(loss_fn, optimizer, params, batches):
    """Plain optax on one device: one update per whole batch."""
    params = jax.tree.map(jnp.asarray, params)
    state = optimizer.init(params)
    for batch in batches:
        grads = jax.grad(loss_fn)(params, batch)
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def train(step: jaxdp.TrainStep, params, batches):
    """Runs ``step`` over global batches (one optimizer step each); returns the state
    and the metrics of every call."""
    state, history = step.init(params), []
    for batch in batches:
        sizes = (
            step.sizes(batch)
            if step.path == "fused"
            else jaxdp.batch_sizes(
                num_devices=step.num_devices,
                accum_steps=step.accum_steps,
                global_batch_size=len(jax.tree.leaves(batch)[0]),
            )
        )
        calls = [batch] if step.path == "fused" else jaxdp.micro_batches(batch, sizes)
        for call in calls:
            state, metrics = step(state, call)
            history.append(jax.device_get(metrics))
    return state, history

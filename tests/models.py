"""Small models, data and drivers shared by the tests."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

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


class MegatronMLP(nnx.Module):
    """``mlp_params``' MLP as an NNX module whose kernels carry Megatron's tensor-parallel
    shardings over a ``"model"`` axis (``kernel_metadata``'s ``out_sharding``, as
    ``nnx.with_partitioning`` writes it): ``fc1`` column-split (its kernel's and bias's
    outputs), ``fc2`` row-split (its kernel's inputs; its bias whole), so that ``fc2``'s
    products are partial sums over the axis, which XLA all-reduces. Made without a mesh
    (``eager_sharding=False``): the step places each leaf as its metadata says."""

    def __init__(self, sizes=(8, 16, 3), seed: int = 0):
        start = mlp_params(seed, sizes)

        def linear(i, kernel, bias):
            w, b = start[f"w{i}"], start[f"b{i}"]
            layer = nnx.Linear(
                *w.shape,
                rngs=nnx.Rngs(0),
                param_dtype=w.dtype,
                kernel_metadata={"out_sharding": kernel, "eager_sharding": False},
                bias_metadata={"out_sharding": bias, "eager_sharding": False},
            )
            layer.kernel[...], layer.bias[...] = jnp.asarray(w), jnp.asarray(b)
            return layer

        self.fc1 = linear(0, (None, "model"), ("model",))
        self.fc2 = linear(1, ("model", None), (None,))

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def megatron_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


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


def unpadded(actual, expected):
    """``actual`` (a ZeRO stage-3 state's parameters or optimizer state) in ``expected``'s
    shapes: a leaf the state holds padded along one dimension is sliced to the expected
    shape, after asserting that its padding is exactly zero; every other leaf as it is
    (a leaf of another rank, or smaller, stays so: the comparison then names it)."""

    def cut(a, b):
        a_shape, b_shape = np.shape(a), np.shape(b)
        if len(a_shape) != len(b_shape):
            return a
        longer = [i for i, (m, n) in enumerate(zip(a_shape, b_shape, strict=True)) if m != n]
        if len(longer) != 1 or a_shape[longer[0]] < b_shape[longer[0]]:
            return a
        a = np.asarray(a)
        (d,) = longer
        padding = np.take(a, range(b_shape[d], a_shape[d]), axis=d)
        np.testing.assert_array_equal(padding, 0, err_msg="the padding holds other than zeros")
        return np.take(a, range(b_shape[d]), axis=d)

    return jax.tree.map(cut, actual, expected)

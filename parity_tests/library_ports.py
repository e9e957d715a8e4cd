"""A torch model with RMSNorm and its ports in Flax NNX, Flax Linen and equinox, under the
torch model's attribute names (the weight map needs no mapping), and a torch model with
BatchNorm and its Linen port; for jaxdp.parity.compare_models and `jaxdp parity`.

RMSNet: ``fc1`` Linear(8, 16), ``norm`` RMSNorm(16, eps=1e-6), SiLU, ``fc2`` Linear(16, 4)
over ``[B, 8]`` features. BNNet: ``fc1`` without bias (BatchNorm cancels a bias: its true
gradient is zero, and Adam turns the rounding noise into full steps), ``bn``
BatchNorm1d(16), ReLU, ``fc2``. Spawned
DDP ranks import this module by name (it is on the test's ``sys.path``).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch.nn.functional as F
from flax import linen, nnx
from torch import nn

EPSILON = 1e-6  # given on both sides: torch's default (None) is finfo(dtype).eps, flax's 1e-6


class TorchRMSNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.RMSNorm(16, eps=EPSILON)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.silu(self.norm(self.fc1(x))))


class NNXRMSNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, epsilon: float = EPSILON):
        self.fc1 = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.RMSNorm(16, epsilon=epsilon, rngs=rngs)
        self.fc2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.silu(self.norm(self.fc1(x))))


class LinenRMSNet(linen.Module):
    epsilon: float = EPSILON

    def setup(self):  # attributes named as torch's; @compact would need name="fc1"
        self.fc1 = linen.Dense(16)
        self.norm = linen.RMSNorm(epsilon=self.epsilon)
        self.fc2 = linen.Dense(4)

    def __call__(self, x):
        return self.fc2(jax.nn.silu(self.norm(self.fc1(x))))


class EqxRMSNet(eqx.Module):
    fc1: eqx.nn.Linear
    norm: eqx.nn.RMSNorm
    fc2: eqx.nn.Linear

    def __init__(self, key: jax.Array, epsilon: float = EPSILON):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(8, 16, key=k1)
        self.norm = eqx.nn.RMSNorm(16, eps=epsilon, use_bias=False)  # torch's has no bias
        self.fc2 = eqx.nn.Linear(16, 4, key=k2)

    def __call__(self, x):  # one example, as equinox layers take
        return self.fc2(jax.nn.silu(self.norm(self.fc1(x))))


def nnx_flax_epsilon(*, rngs: nnx.Rngs) -> NNXRMSNet:
    """A broken port: epsilon 1e-5 against torch's 1e-6."""
    return NNXRMSNet(rngs=rngs, epsilon=1e-5)


def linen_flax_epsilon() -> LinenRMSNet:
    """A broken Linen port: epsilon 1e-5 against torch's 1e-6."""
    return LinenRMSNet(epsilon=1e-5)


def eqx_flax_epsilon(key: jax.Array) -> EqxRMSNet:
    """A broken equinox port: epsilon 1e-5 against torch's 1e-6."""
    return EqxRMSNet(key, epsilon=1e-5)


# ---- BatchNorm -------------------------------------------------------------------------------


class TorchBNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16, bias=False)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


class TorchLikeBatchNorm(linen.Module):
    """torch's BatchNorm1d in Linen: linen.BatchNorm updates its running variance with the
    batch's biased variance, torch with the unbiased one (times n / (n - 1))."""

    momentum: float = 0.1  # torch's convention
    epsilon: float = 1e-5

    @linen.compact
    def __call__(self, x, train: bool):
        features = x.shape[-1]
        scale = self.param("scale", linen.initializers.ones, (features,))
        bias = self.param("bias", linen.initializers.zeros, (features,))
        ra_mean = self.variable("batch_stats", "mean", jnp.zeros, (features,))
        ra_var = self.variable("batch_stats", "var", jnp.ones, (features,))
        if train:
            mean, var = x.mean(0), jnp.square(x - x.mean(0)).mean(0)
            n, m = x.shape[0], self.momentum
            if not self.is_initializing():
                ra_mean.value = (1 - m) * ra_mean.value + m * jax.lax.stop_gradient(mean)
                unbiased = jax.lax.stop_gradient(var) * n / (n - 1)
                ra_var.value = (1 - m) * ra_var.value + m * unbiased
        else:
            mean, var = ra_mean.value, ra_var.value
        return (x - mean) / jnp.sqrt(var + self.epsilon) * scale + bias


class LinenBNNet(linen.Module):
    flax_batch_norm: bool = False  # linen.BatchNorm: its running variance is biased

    @linen.compact
    def __call__(self, x, train: bool):
        x = linen.Dense(16, use_bias=False, name="fc1")(x)
        if self.flax_batch_norm:
            bn = linen.BatchNorm(momentum=0.9, epsilon=1e-5, name="bn")  # torch's momentum 0.1
            x = bn(x, use_running_average=not train)
        else:
            x = TorchLikeBatchNorm(name="bn")(x, train)
        return linen.Dense(4, name="fc2")(jax.nn.relu(x))


def linen_flax_batch_norm() -> LinenBNNet:
    return LinenBNNet(flax_batch_norm=True)


def features(n: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8))
    return x, np.argmax(x @ rng.normal(size=(8, 4)), axis=1).astype(np.int64)


def torch_rms_net_frozen_bias() -> TorchRMSNet:
    """TorchRMSNet with ``fc1.bias`` frozen (``requires_grad=False``)."""
    model = TorchRMSNet()
    model.fc1.bias.requires_grad_(False)
    return model

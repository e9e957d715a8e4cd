"""A team's own torch training script, reduced to what parity needs: a tiny language model
over padded token rows, a token-weighted cross-entropy (the sum over real tokens and their
number; padding labelled -100, as Hugging Face's), a warm-up-then-decay ``LambdaLR``, and
the JAX port of each. Spawned DDP ranks import this module by name."""

import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.nn.functional as F
from flax import nnx
from torch import nn

VOCAB, D, TOKENS, ROWS = 11, 6, 5, 48
BASE_LR, WARMUP, STEPS = 0.01, 3, 10


class TorchLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x):  # [B, T] tokens -> [B, T, VOCAB]
        return self.head(torch.tanh(self.embed(x)))


class JaxLM(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs, param_dtype=param_dtype)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x):
        return self.head(jnp.tanh(self.embed(x)))


def torch_token_loss(out, y):
    """(sum of the real tokens' cross-entropies, their number)."""
    real = (y != -100).reshape(-1)
    ce = F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1).clamp(min=0), reduction="none")
    return (ce * real).sum(), real.sum().to(out.dtype)


def jax_token_loss(out, y):
    real = (y != -100).reshape(-1)
    ce = optax.softmax_cross_entropy_with_integer_labels(
        out.reshape(-1, VOCAB), jnp.maximum(y, 0).reshape(-1)
    )
    return jnp.sum(ce * real), jnp.sum(real).astype(out.dtype)


def warmup_decay(i):
    """LambdaLR's factor at step i: a linear warm-up, then a linear decay to 0."""
    return min((i + 1) / WARMUP, (STEPS - i) / (STEPS - WARMUP + 1))


def torch_schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay)


def optax_schedule(count):
    """The same rate in optax: the update after ``count`` updates, in float64."""
    i = jnp.asarray(count, jnp.float64)
    return BASE_LR * jnp.minimum((i + 1) / WARMUP, (STEPS - i) / (STEPS - WARMUP + 1))


def data(seed=0):
    """Rows of 1 to TOKENS real tokens, padded with token 0 and label -100."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, VOCAB, size=(ROWS, TOKENS))
    y = rng.integers(0, VOCAB, size=(ROWS, TOKENS))
    lengths = rng.integers(1, TOKENS + 1, size=ROWS)
    pad = np.arange(TOKENS)[None, :] >= lengths[:, None]
    return np.where(pad, 0, x), np.where(pad, -100, y)

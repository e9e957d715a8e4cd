"""Model pairs for jaxdp.parity.compare_models, as a porting engineer would write them: a torch
model and its Flax NNX port with the same attribute names, and ports broken on purpose.

ResCNN: a stem convolution, one residual block of two 3x3 convolutions with GroupNorm,
a global mean and a linear head; images NCHW ``[B, 1, 6, 6]`` (the JAX port moves the
channels last). Encoder: a one-block transformer encoder (pre-LayerNorm,
``nn.MultiheadAttention`` / ``nnx.MultiHeadAttention``, an exact-GELU MLP) over
``[B, 6]`` tokens, mean-pooled into 4 logits, with a learned position table ``pos``.
Spawned DDP ranks import this module by name (it is on the test's ``sys.path``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from flax import nnx
from torch import nn

D, HEADS, VOCAB, TOKENS, CLASSES = 8, 2, 16, 6, 4


class TorchResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(2, c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(2, c)

    def forward(self, x):
        h = F.relu(self.norm1(self.conv1(x)))
        return F.relu(x + self.norm2(self.conv2(h)))


class TorchResCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.block = TorchResBlock(8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):  # [B, 1, H, W]
        return self.head(self.block(F.relu(self.stem(x))).mean(dim=(2, 3)))


def _group_norm(c: int, rngs: nnx.Rngs) -> nnx.GroupNorm:
    # torch's epsilon (flax's default is 1e-6) and two-pass variance.
    return nnx.GroupNorm(c, num_groups=2, epsilon=1e-5, use_fast_variance=False, rngs=rngs)


class JaxResBlock(nnx.Module):
    def __init__(self, c: int, *, rngs: nnx.Rngs):
        conv = dict(kernel_size=(3, 3), padding=((1, 1), (1, 1)), use_bias=False, rngs=rngs)
        self.conv1 = nnx.Conv(c, c, **conv)
        self.norm1 = _group_norm(c, rngs)
        self.conv2 = nnx.Conv(c, c, **conv)
        self.norm2 = _group_norm(c, rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.norm1(self.conv1(x)))
        return jax.nn.relu(x + self.norm2(self.conv2(h)))


class JaxResCNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.stem = nnx.Conv(1, 8, kernel_size=(3, 3), padding=((1, 1), (1, 1)), rngs=rngs)
        self.block = JaxResBlock(8, rngs=rngs)
        self.head = nnx.Linear(8, CLASSES, rngs=rngs)

    def __call__(self, x):  # NCHW in, as torch's
        h = jax.nn.relu(self.stem(x.transpose(0, 2, 3, 1)))
        return self.head(self.block(h).mean(axis=(1, 2)))


class TorchFeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)  # square, so a kernel left untransposed still fits
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))  # exact (erf) GELU, torch's default


class TorchEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(0.1 * torch.randn(TOKENS, D))
        self.ln1 = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.ln2 = nn.LayerNorm(D)
        self.mlp = TorchFeedForward()
        self.head = nn.Linear(D, CLASSES)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos
        a = self.ln1(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        h = h + self.mlp(self.ln2(h))
        return self.head(h.mean(dim=1))


def attention(query, key, value, bias=None, mask=None, **_):
    """Softmax attention in the inputs' dtype ([batch, length, heads, head_dim] in and
    out). nnx.MultiHeadAttention's default (without dropout) calls
    jax.nn.dot_product_attention, whose softmax runs in float32: 3e-8 off torch's in
    float64, which the divergence locator finds in ``attn``."""
    logits = jnp.einsum("...qhd,...khd->...hqk", query / jnp.sqrt(query.shape[-1]), key)
    return jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(logits, axis=-1), value)


class JaxFeedForward(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, approximate: bool = False):
        self.fc = nnx.Linear(D, D, rngs=rngs)
        self.proj = nnx.Linear(D, D, rngs=rngs)
        self.approximate = approximate

    def __call__(self, x):
        return self.proj(jax.nn.gelu(self.fc(x), approximate=self.approximate))


class JaxEncoder(nnx.Module):
    def __init__(
        self,
        *,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        ln_epsilon: float = 1e-5,
        approximate: bool = False,
    ):
        # nnx.Embed computes in the dtype it was built with: build it in the run's dtype.
        self.embed = nnx.Embed(VOCAB, D, param_dtype=param_dtype, rngs=rngs)
        self.pos = nnx.Param(jnp.zeros((TOKENS, D)))
        self.ln1 = nnx.LayerNorm(D, epsilon=1e-5, use_fast_variance=False, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            HEADS, D, decode=False, attention_fn=attention, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(D, epsilon=ln_epsilon, use_fast_variance=False, rngs=rngs)
        self.mlp = JaxFeedForward(rngs=rngs, approximate=approximate)
        self.head = nnx.Linear(D, CLASSES, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens) + self.pos[...]
        h = h + self.attn(self.ln1(h))
        h = h + self.mlp(self.ln2(h))
        return self.head(h.mean(axis=1))


# ---- broken ports --------------------------------------------------------------------------


def encoder_flax_epsilon(*, rngs: nnx.Rngs, param_dtype) -> JaxEncoder:
    """ln2 keeps flax's LayerNorm epsilon, 1e-6 (torch's is 1e-5)."""
    return JaxEncoder(rngs=rngs, param_dtype=param_dtype, ln_epsilon=1e-6)


def encoder_tanh_gelu(*, rngs: nnx.Rngs, param_dtype) -> JaxEncoder:
    """The MLP's GELU is jax.nn.gelu's default, the tanh approximation (torch: exact)."""
    return JaxEncoder(rngs=rngs, param_dtype=param_dtype, approximate=True)


# mlp.fc's weight loaded as it is, without the Linear transpose.
UNTRANSPOSED = {"mlp.fc.weight": ("mlp.fc.kernel", lambda w: w)}


def jax_summed_window_loss(accum_steps: int):
    """A JAX loss that sums the window, as a loop without `loss / accum_steps` does."""

    def loss(out, y):
        import optax

        ce = optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
        return ce * accum_steps

    return loss


# ---- data ---------------------------------------------------------------------------------


def images(n: int = 32, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 1, 6, 6))
    y = np.argmax(x.reshape(n, -1) @ rng.normal(size=(36, CLASSES)), axis=1)
    return x, y.astype(np.int64)


def tokens(n: int = 32, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(n, TOKENS))
    y = (x[:, 0] + x[:, -1]) % CLASSES
    return x.astype(np.int64), y.astype(np.int64)

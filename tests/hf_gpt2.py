"""A user's NNX port of Hugging Face's GPT-2 (GPT2LMHeadModel), under transformers' names:
docs/check-your-port.md section 9 writes the same port."""

import jax
import jax.numpy as jnp
from flax import nnx
from transformers import GPT2Config, GPT2LMHeadModel


def tiny_config() -> GPT2Config:
    """2 layers of width 16; dropout off (the two frameworks draw different masks)."""
    return GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


class GPT2Logits(GPT2LMHeadModel):
    """compare_models reads a tensor: the logits, not transformers' ModelOutput."""

    def forward(self, x):
        return super().forward(x, use_cache=False).logits


class Attention(nnx.Module):
    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        d, kw = config.n_embd, dict(rngs=rngs, param_dtype=param_dtype, dtype=param_dtype)
        self.heads = config.n_head
        self.c_attn = nnx.Linear(d, 3 * d, **kw)  # transformers' Conv1D: weight [in, out]
        self.c_proj = nnx.Linear(d, d, **kw)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(scores.dtype).min))
        return self.c_proj(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d))


class MLP(nnx.Module):
    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        d, kw = config.n_embd, dict(rngs=rngs, param_dtype=param_dtype, dtype=param_dtype)
        self.c_fc = nnx.Linear(d, 4 * d, **kw)
        self.c_proj = nnx.Linear(4 * d, d, **kw)

    def __call__(self, x):
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True))  # "gelu_new"


class Block(nnx.Module):
    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        norm = dict(epsilon=config.layer_norm_epsilon, use_fast_variance=False, dtype=param_dtype)
        self.ln_1 = nnx.LayerNorm(config.n_embd, **norm, **kw)
        self.attn = Attention(config, **kw)
        self.ln_2 = nnx.LayerNorm(config.n_embd, **norm, **kw)
        self.mlp = MLP(config, **kw)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Body(nnx.Module):  # transformers' GPT2Model, the "transformer." of its keys
    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=param_dtype)
        self.wte = nnx.Embed(config.vocab_size, config.n_embd, **kw)
        self.wpe = nnx.Embed(config.n_positions, config.n_embd, **kw)
        self.h = nnx.List(
            [Block(config, rngs=rngs, param_dtype=param_dtype) for _ in range(config.n_layer)]
        )
        self.ln_f = nnx.LayerNorm(
            config.n_embd, epsilon=config.layer_norm_epsilon, use_fast_variance=False, **kw
        )

    def __call__(self, ids):
        x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[1]))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2Port(nnx.Module):
    def __init__(self, config, *, rngs, param_dtype=jnp.float32):
        self.transformer = Body(config, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, ids):
        # lm_head is tied to wte, as in GPT2LMHeadModel
        return self.transformer.wte.attend(self.transformer(ids))

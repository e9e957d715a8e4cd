"""The reference GPT in scanned-layer form: its blocks made once with ``nnx.vmap`` (every
leaf of ``blocks`` has a leading layer axis) and run by :func:`jaxdp.scan_layers`, so
that at ZeRO stage 3 the step gathers one block at a time (docs/semantics.md, "ZeRO
stage 3").

It computes what :class:`~jaxdp.models.Transformer` computes with ``n_layers`` blocks in
a row: the same modules (:class:`Block`), the same attribute names, the block's leaves
stacked under ``blocks`` instead of held under ``block``; :func:`stack_blocks` turns the
one into the other.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .._layers import scan_layers
from .._shards import name_layer_axis
from ._reference import Block, _layer_norm


class ScannedTransformer(nnx.Module):
    """A GPT of ``n_layers`` pre-LayerNorm blocks: token + position embeddings, the blocks
    (stacked, looped by :func:`jaxdp.scan_layers`), final LayerNorm, linear head.

    ``tokens [B, T]`` (``T <= block_size``) -> logits ``[B, T, num_outputs]``;
    ``num_outputs`` None is ``vocab_size`` (a language model's head), a class count
    makes each position's logits a classification (``jaxdp train --model gpt`` reads the
    last position's, which attends to every token). ``dtype``: the compute dtype (e.g.
    bfloat16 over float32 parameters), each block's parameters cast inside the loop,
    so that at stage 3 the cast follows the gather of one layer (a cast of the whole
    stack before :func:`jaxdp.scan_layers` would gather it whole); None: the parameters'.
    """

    def __init__(
        self,
        vocab_size: int = 32,
        block_size: int = 8,
        d_model: int = 16,
        n_heads: int = 2,
        n_layers: int = 2,
        *,
        num_outputs: int | None = None,
        dtype: Any = None,
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
    ):
        if n_layers < 1:
            raise ValueError(f"n_layers={n_layers} must be at least 1")
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.dtype = dtype
        self.tok_emb = nnx.Embed(vocab_size, d_model, **kw)
        self.pos_emb = nnx.Embed(block_size, d_model, **kw)

        # One key per block (split_rngs), so the blocks start different, as n Blocks would.
        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs: nnx.Rngs) -> Block:
            return Block(d_model, n_heads, rngs=rngs, param_dtype=param_dtype)

        self.blocks = name_layer_axis(blocks(rngs))  # a stack of layers (metadata)
        self.ln_f = _layer_norm(d_model, **kw)
        self.head = nnx.Linear(d_model, num_outputs or vocab_size, use_bias=False, **kw)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        def cast(module: nnx.Module) -> nnx.Module:
            return module if self.dtype is None else _cast(module, self.dtype)

        def embed(table: nnx.Embed, ids: jax.Array) -> jax.Array:
            # nnx.Embed computes in the dtype it was built with: cast the rows it picks.
            rows = table(ids)
            return rows if self.dtype is None else rows.astype(self.dtype)

        h = embed(self.tok_emb, tokens) + embed(self.pos_emb, jnp.arange(tokens.shape[1]))
        h = scan_layers(lambda block, h: cast(block)(h), self.blocks, h)
        return cast(self.head)(cast(self.ln_f)(h))


def _cast(module: nnx.Module, dtype: Any) -> nnx.Module:
    """A copy of ``module`` with its parameters cast to ``dtype`` (differentiable: the
    gradients reach the parameters in their own dtype)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    return nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(dtype), params), rest)


def stack_blocks(state: Any, blocks: list[str]) -> Any:
    """The parameters of :class:`ScannedTransformer` from an unscanned model's
    ``nnx.state``: the subtrees named in ``blocks`` (in layer order: ``["block"]`` for
    :class:`~jaxdp.models.Transformer`) stacked along a new leading axis under
    ``blocks``; every other entry as it is. ``nnx.update(scanned, stack_blocks(...))``
    loads them."""
    plain = nnx.to_pure_dict(state)
    missing = [name for name in blocks if name not in plain]
    if missing:
        raise ValueError(f"blocks={blocks}: {missing} not in the state's {sorted(plain)}")
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(plain[name] for name in blocks))
    rest = {k: v for k, v in plain.items() if k not in blocks}
    return {**rest, "blocks": stacked}

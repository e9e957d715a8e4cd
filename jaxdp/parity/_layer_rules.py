"""Layer rules of the weight map: which JAX leaves a torch layer's tensor fills, and how
its layout changes on the way (the tables in :mod:`jaxdp.parity._mapping`).

Two layouts: ``"flax"`` (NNX and Linen: ``kernel`` ``[in, out]`` and ``[*k, I, O]``,
``scale``, ``embedding``) and ``"torch"`` (equinox: torch's names and layouts, a
convolution's bias ``[O, 1, ...]``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

Transform = Callable[[np.ndarray], Any]
Layout = Literal["flax", "torch"]


def _transpose(w: np.ndarray) -> np.ndarray:
    return w.T


def _conv(w: np.ndarray) -> np.ndarray:
    return np.transpose(w, (*range(2, w.ndim), 1, 0))


def same(w: np.ndarray) -> np.ndarray:
    return w


def kind(module: Any) -> str:
    from torch import nn

    if _is_hf_conv1d(module):
        return "hf_conv1d"
    if isinstance(module, nn.MultiheadAttention):
        return "mha"
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return "conv"
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, *_rms_norm(nn))):
        return "norm"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "batchnorm"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return "other"


def _is_hf_conv1d(module: Any) -> bool:
    """transformers' Conv1D (GPT-2's projections: ``weight`` ``[in, out]``). An instance
    exists only once transformers has imported the module that defines it, so it is
    looked up there, never imported."""
    defining = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(defining, "Conv1D", None)
    return isinstance(conv1d, type) and isinstance(module, conv1d)


def _rms_norm(nn: Any) -> tuple[type, ...]:
    # nn.RMSNorm came with torch 2.4; jaxdp names no oldest torch.
    return (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()


# (torch layer kind, tensor name) -> (JAX leaf names to try, transform, description)
_RULES: dict[tuple[str, str], tuple[tuple[str, ...], Transform, str]] = {
    ("linear", "weight"): (("kernel",), _transpose, "Linear [out, in] -> [in, out]"),
    ("hf_conv1d", "weight"): (("kernel",), same, "Conv1D [in, out], as is"),
    ("conv", "weight"): (("kernel",), _conv, "Conv [O, I, *k] -> [*k, I, O]"),
    ("norm", "weight"): (("scale",), same, "as is"),
    ("batchnorm", "weight"): (("scale",), same, "as is"),
    ("embedding", "weight"): (("embedding",), same, "as is"),
    ("batchnorm", "running_mean"): (("running_mean", "mean"), same, "as is"),
    ("batchnorm", "running_var"): (("running_var", "var"), same, "as is"),
}


def rule(
    name: str, modules: dict[str, Any], layout: Layout = "flax"
) -> tuple[tuple[str, ...], Transform, str]:
    """``(JAX leaf names, transform, description)`` of torch tensor ``name`` by its layer."""
    owner_path, _, leaf = name.rpartition(".")
    default = ((leaf,), same, "as is")
    owner = modules.get(owner_path)
    if layout == "torch":
        if kind(owner) == "hf_conv1d" and leaf == "weight":  # as eqx.nn.Linear: [out, in]
            return (leaf,), _transpose, "Conv1D [in, out] -> [out, in]"
        if kind(owner) == "conv" and leaf == "bias":
            return (leaf,), _conv_bias(owner.weight.ndim), "Conv bias [O] -> [O, 1, ...]"
        return default
    return _RULES.get((kind(owner), leaf), default)


def _conv_bias(ndim: int) -> Transform:
    # equinox's Conv adds a bias of shape [O, 1, ...] to its [O, *spatial] output.
    def reshape(b: np.ndarray) -> np.ndarray:
        return b.reshape(b.shape[0], *(1,) * (ndim - 2))

    return reshape


def candidates(
    name: str, modules: dict[str, Any], layout: Layout = "flax"
) -> list[tuple[tuple[str, ...], Transform, str]]:
    """``(JAX paths, transform, description)`` to try, in order, for torch tensor ``name``."""
    owner_path, _, leaf = name.rpartition(".")
    prefix = owner_path + "." if owner_path else ""
    out = _attention_candidates(name, modules, layout)
    targets, transform, how = rule(name, modules, layout)
    out += [((prefix + target,), transform, how) for target in targets]
    if (name,) not in [paths for paths, _, _ in out]:
        out.append(((name,), same, "as is"))
    return out


def _attention_candidates(
    name: str, modules: dict[str, Any], layout: Layout
) -> list[tuple[tuple[str, ...], Transform, str]]:
    """The layout of nnx.MultiHeadAttention and Linen's MultiHeadDotProductAttention
    (``"flax"``) or of eqx.nn.MultiheadAttention (``"torch"``) for a torch
    MultiheadAttention's tensors."""
    owner_path, _, leaf = name.rpartition(".")
    owner = modules.get(owner_path)
    prefix = owner_path + "." if owner_path else ""
    flax = layout == "flax"
    if kind(owner) == "mha" and leaf in ("in_proj_weight", "in_proj_bias"):
        weight = leaf == "in_proj_weight"
        target = ("kernel" if weight else "bias") if flax else ("weight" if weight else "bias")
        parts = ("query", "key", "value") if flax else ("query_proj", "key_proj", "value_proj")
        paths = tuple(f"{prefix}{p}.{target}" for p in parts)
        split = _mha_in(owner, weight) if flax else _thirds
        return [(paths, split, "in_proj split into q, k, v")]
    parent_path, _, child = owner_path.rpartition(".")
    parent = modules.get(parent_path)
    if child == "out_proj" and kind(parent) == "mha" and leaf in ("weight", "bias"):
        base = parent_path + "." if parent_path else ""
        if not flax:
            return [((f"{base}output_proj.{leaf}",), same, "out_proj")]
        target = "kernel" if leaf == "weight" else "bias"
        return [((f"{base}out.{target}",), _mha_out(parent, leaf == "weight"), "out_proj")]
    return []


def _thirds(w: np.ndarray) -> tuple[np.ndarray, ...]:
    return tuple(np.split(w, 3, axis=0))


def _mha_in(mha: Any, weight: bool) -> Transform:
    heads, d = mha.num_heads, mha.embed_dim

    def split(w: np.ndarray) -> tuple[np.ndarray, ...]:
        parts = np.split(w, 3, axis=0)
        if weight:  # [d, in] each -> [in, heads, head_dim]
            return tuple(p.T.reshape(p.shape[1], heads, d // heads) for p in parts)
        return tuple(p.reshape(heads, d // heads) for p in parts)

    return split


def _mha_out(mha: Any, weight: bool) -> Transform:
    heads, d = mha.num_heads, mha.embed_dim

    def out(w: np.ndarray) -> np.ndarray:
        return w.T.reshape(heads, d // heads, w.shape[0]) if weight else w

    return out

"""Weights between PyTorch state_dicts and jaxdp parameter trees (numpy only).

A parameter path ``("block", "attn", "query", "kernel")`` is the torch key
``block.attn.query.weight``. The leaf name says the layer kind and layout:

==============  ==================  ====================  =====================
jaxdp leaf      torch name          jaxdp layout          torch layout
==============  ==================  ====================  =====================
``kernel`` 2-D  ``weight``          ``[in, out]``         ``[out, in]`` (Linear)
``kernel`` 4-D  ``weight``          ``[kh, kw, in, out]`` ``[out, in, kh, kw]``
``scale``       ``weight``          ``[d]``               ``[d]`` (LayerNorm)
``embedding``   ``weight``          ``[n, d]``            ``[n, d]`` (Embedding)
other           same name           same                  same
==============  ==================  ====================  =====================

torch itself is never imported: tensors are read through ``numpy.asarray``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

_TORCH_NAME = {"kernel": "weight", "scale": "weight", "embedding": "weight"}
# jaxdp kernel layout -> torch layout, by rank (the inverse is argsort of it).
_TO_TORCH_AXES = {2: (1, 0), 4: (3, 2, 0, 1)}


def params_to_torch(params: Any) -> dict[str, np.ndarray]:
    """A torch-style state_dict (numpy arrays) of an NNX module's or a pytree's parameters.

    For a module, its ``nnx.BatchStat`` variables come along as buffers under
    their own names (:class:`jaxdp.models.BatchNorm`'s are torch's ``running_mean``,
    ``running_var`` and ``num_batches_tracked``, in torch's conventions).
    """
    out = {}
    for path, value in _flat_params(params).items():
        key, axes = _torch_key(path, np.ndim(value))
        out[key] = np.transpose(np.asarray(value), axes)
    return out


def torch_to_params(state_dict: Mapping[str, Any], like: Any) -> Any:
    """The parameters of ``like`` (an NNX module or a pytree) with values from ``state_dict``.

    A module's ``nnx.BatchStat`` variables (buffers) are read too, by name.

    Keys may carry DDP's ``module.`` prefix. Returns a new module (or tree) of
    ``like``'s structure and dtypes; ``like`` is not changed. Raises
    ``KeyError`` for a missing tensor, ``ValueError`` for a mis-shaped one or
    for tensors ``like`` has no parameter for (as ``load_state_dict(strict=True)``).
    """
    tensors = {_strip_ddp(key): _to_numpy(value) for key, value in state_dict.items()}
    flat = _flat_params(like)
    values = {}
    for path, current in flat.items():
        name = ".".join(map(str, path))
        key, axes = _torch_key(path, np.ndim(current))
        if key not in tensors:
            raise KeyError(
                f"state_dict has no {key!r} for parameter {name} of shape {np.shape(current)}"
            )
        tensor = tensors[key]
        want = tuple(np.shape(current)[a] for a in axes)
        if tensor.shape != want:
            raise ValueError(
                f"state_dict[{key!r}] has shape {tensor.shape}; parameter {name} of shape "
                f"{np.shape(current)} needs a torch tensor of shape {want}"
            )
        values[path] = np.transpose(tensor, np.argsort(axes)).astype(current.dtype)
    extra = sorted(set(tensors) - {_torch_key(p, np.ndim(v))[0] for p, v in flat.items()})
    if extra:
        raise ValueError(f"state_dict has tensors with no matching parameter: {extra}")
    return _replace_params(like, values)


def _torch_key(path: tuple, ndim: int) -> tuple[str, tuple[int, ...]]:
    *parents, leaf = (str(p) for p in path)
    axes = _TO_TORCH_AXES.get(ndim, tuple(range(ndim))) if leaf == "kernel" else None
    return ".".join([*parents, _TORCH_NAME.get(leaf, leaf)]), axes or tuple(range(ndim))


def _flat_params(tree: Any) -> dict[tuple, Any]:
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree, nnx.Any(nnx.Param, nnx.BatchStat))
    if isinstance(tree, nnx.State):
        return {path: var.get_value() for path, var in nnx.to_flat_state(tree)}
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(_key_name(k) for k in path): leaf for path, leaf in leaves}


def _replace_params(like: Any, values: dict[tuple, np.ndarray]) -> Any:
    if isinstance(like, nnx.Module):
        graphdef, params, rest = nnx.split(like, nnx.Any(nnx.Param, nnx.BatchStat), ...)
        return nnx.merge(graphdef, _replace_params(params, values), rest)
    if isinstance(like, nnx.State):
        flat = [(path, var.replace(values[path])) for path, var in nnx.to_flat_state(like)]
        return nnx.from_flat_state(flat)
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    leaves = [values[tuple(_key_name(k) for k in path)] for path, _ in paths]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _strip_ddp(key: str) -> str:
    return key.removeprefix("module.")


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    return np.asarray(value)

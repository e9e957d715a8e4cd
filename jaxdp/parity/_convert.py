"""Weights between PyTorch and jaxdp parameter trees: ``torch_to_params``, ``params_to_torch``.

A parameter path ``("block", "attn", "query", "kernel")`` is the torch key
``block.attn.query.weight``. The leaf name says the layer kind:

==============  ==================  ====================  ==============================
jaxdp leaf      torch name          jaxdp layout          torch layout
==============  ==================  ====================  ==============================
``kernel``      ``weight``          ``[*k, in, out]``     ``"out_in"``: ``[out, in, *k]``
                                                          (nn.Linear, nn.Conv1d/2d/3d);
                                                          ``"in_out"``: ``[in, out]``
                                                          (transformers' Conv1D, GPT-2's
                                                          projections; nn.Embedding)
``scale``       ``weight``          ``[d]``               ``[d]`` (LayerNorm)
``embedding``   ``weight``          ``[n, d]``            ``[n, d]`` (Embedding)
other           same name           same                  same
==============  ==================  ====================  ==============================

A stack of layers (a leaf with a leading layer axis, as ``nnx.vmap`` and Linen's ``nn.scan``
build them) is torch's ``nn.ModuleList`` of identical modules: the leaf ``blocks.fc.kernel``
``[L, in, out]`` is ``blocks.0.fc.weight`` ... ``blocks.{L-1}.fc.weight``, each layer in its
own layout. It is told by the torch side: numbered keys for a leaf with one axis more than
their tensors.

A kernel's torch layout is its layer's: read from the torch module when one is given
(the layer kinds of :mod:`jaxdp.parity._layer_rules`), else from ``layouts``. A bare
state_dict does not say it, and when in and out are the same size (GPT-2's square
``attn.c_proj``) its shape does not either: such a kernel is refused rather than guessed.
torch is never imported here: tensors are read through ``numpy.asarray``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import jax
import numpy as np
from flax import nnx

from ._layer_rules import kind

Layout = Literal["out_in", "in_out"]
"""A torch weight's axes, for a JAX ``kernel`` ``[*k, in, out]``: ``"out_in"`` is
``[out, in, *k]`` (nn.Linear, nn.Conv1d/2d/3d), ``"in_out"`` is ``[in, out, *k]``
(transformers' Conv1D, nn.Embedding read as a kernel)."""
Layouts = Layout | Mapping[str, Layout] | None

_LAYOUTS = ("out_in", "in_out")
_TORCH_NAME = {"kernel": "weight", "scale": "weight", "embedding": "weight"}
# The torch layer kinds (jaxdp.parity._layer_rules.kind) whose weight has a known layout.
_KIND_LAYOUT: dict[str, Layout] = {
    "linear": "out_in",
    "conv": "out_in",
    "hf_conv1d": "in_out",
    "embedding": "in_out",
}


def torch_to_params(source: Any, like: Any, *, layouts: Layouts = None) -> Any:
    """The parameters of ``like`` (an NNX module or a pytree) with values from ``source``:
    a torch ``nn.Module`` (its ``state_dict()``, read with its layers' layouts) or a
    state_dict (a mapping of tensors or arrays, e.g. ``safetensors.torch.load_file``'s).

    A kernel's layout comes from the module's layer (nn.Linear and nn.Conv1d/2d/3d
    ``"out_in"``, transformers' Conv1D and nn.Embedding ``"in_out"``); otherwise from
    ``layouts``: a dict ``{torch key: layout}``, or one :data:`Layout` for every kernel
    the module does not tell. Without either, a kernel whose in and out sizes differ is
    read as ``"out_in"`` if its shape says so, and a square one is refused: its shape
    cannot tell nn.Linear's ``[out, in]`` from Conv1D's ``[in, out]``.

    A leaf with a leading layer axis (layers stacked by ``nnx.vmap`` or Linen's
    ``nn.scan``) whose key ``source`` lacks is read from an ``nn.ModuleList``'s numbered
    keys: ``blocks.fc.kernel`` ``[L, in, out]`` from ``blocks.0.fc.weight`` ...
    ``blocks.{L-1}.fc.weight``, each of one axis less, in its layer's layout.

    A module's ``nnx.BatchStat`` variables (buffers) are read too, by name. Keys may
    carry DDP's ``module.`` prefix. A tensor tied to one that was read (a module's
    ``lm_head.weight`` that is its ``wte.weight``) may stay unused. Returns a new module
    (or tree) of ``like``'s structure and dtypes; ``like`` is not changed.

    Raises:
      KeyError: a parameter of ``like`` has no tensor.
      ValueError: a tensor of the wrong shape, a square kernel of unknown layout (named
        with the fix), a tensor ``like`` has no parameter for (as
        ``load_state_dict(strict=True)``), a ``layouts`` entry that names no kernel, or a
        module list whose layers are not numbered 0 to L - 1 for a stacked leaf of L
        layers (naming the missing or left-over key).
    """
    theirs = _read(source)
    tensors = theirs.tensors
    _check_layouts(layouts, tensors)
    flat = _flat_params(like)
    values, used = {}, set()
    for path, current in flat.items():
        name = ".".join(map(str, path))
        key = _torch_key(path)
        shape = np.shape(current)
        stacked = None if key in tensors else _layer_keys(key, tensors, name, shape)
        if key not in tensors and stacked is None:
            raise KeyError(f"state_dict has no {key!r} for parameter {name} of shape {shape}")
        if stacked is not None:  # one torch tensor per layer, each of the layer's shape
            shape = shape[1:]
        layers = []
        for layer_key in stacked or [key]:
            tensor = tensors[layer_key]
            if path[-1] == "kernel":
                layout = _kernel_layout(layer_key, tensor.shape, shape, name, theirs, layouts)
            else:
                layout = None
            axes = _torch_axes(layout, len(shape))
            want = tuple(shape[a] for a in axes)
            if tensor.shape != want:
                of = f"parameter {name} of shape {np.shape(current)}"
                if stacked is not None:
                    of = f"layer {len(layers)} of the stacked {of}"
                raise ValueError(
                    f"state_dict[{layer_key!r}] has shape {tensor.shape}; {of} needs a torch "
                    f"tensor of shape {want}" + _layout_hint(layer_key, layout, theirs)
                )
            layers.append(np.transpose(tensor, np.argsort(axes)).astype(current.dtype))
            used.add(layer_key)
        values[path] = layers[0] if stacked is None else np.stack(layers)
    extra = sorted(k for k in set(tensors) - used if theirs.tied.get(k) not in used)
    if extra:
        raise ValueError(f"state_dict has tensors with no matching parameter: {extra}")
    return _replace_params(like, values)


def params_to_torch(
    params: Any, like: Any = None, *, layouts: Layouts = "out_in"
) -> dict[str, np.ndarray]:
    """A torch-style state_dict (numpy arrays) of an NNX module's or a pytree's parameters.

    ``like``: the torch ``nn.Module`` it is for. Then each kernel takes its layer's
    layout (transformers' Conv1D ``[in, out]``, nn.Linear ``[out, in]``), the keys are
    exactly ``like.state_dict()``'s (a tied tensor gets its twin's value), and
    ``like.load_state_dict({k: torch.from_numpy(v) ...})`` takes it; a leaf with a
    leading layer axis becomes the numbered layers of ``like``'s ``nn.ModuleList``
    (``blocks.fc.kernel`` ``[L, in, out]``: ``blocks.0.fc.weight`` ...), which need
    ``like`` (a module or its state_dict) to be known. ``layouts`` names
    the layout of the kernels ``like`` does not tell (by torch key, or one for all);
    without ``like``, every kernel is written ``"out_in"`` (nn.Linear's, nn.Conv's)
    unless ``layouts`` says otherwise.

    For a module, its ``nnx.BatchStat`` variables come along as buffers under
    their own names (:class:`jaxdp.models.BatchNorm`'s are torch's ``running_mean``,
    ``running_var`` and ``num_batches_tracked``, in torch's conventions).

    Raises:
      KeyError: ``like`` has a tensor ``params`` has no value for.
      ValueError: a value whose shape is not ``like``'s tensor's, a parameter ``like``
        has no tensor for, or a module list of another length than a stacked leaf's.
    """
    flat = _flat_params(params)
    theirs = _read(like) if like is not None else _Torch({}, {}, {}, {})
    _check_layouts(layouts, {_torch_key(p): None for p in flat} | theirs.tensors)
    out = {}
    for path, value in flat.items():
        key, value = _torch_key(path), np.asarray(value)
        stacked = None
        if key not in theirs.tensors:
            stacked = _layer_keys(key, theirs.tensors, ".".join(map(str, path)), value.shape)
        layers = [(key, value)] if stacked is None else zip(stacked, value, strict=True)
        for layer_key, layer in layers:
            layout = None
            if path[-1] == "kernel":
                layout = theirs.layouts.get(layer_key) or _named(layouts, layer_key) or "out_in"
            out[layer_key] = np.transpose(layer, _torch_axes(layout, layer.ndim))
    if like is None:
        return out
    extra = sorted(set(out) - set(theirs.tensors))
    if extra:
        raise ValueError(f"the torch module has no tensor for parameters {extra}")
    for key, twin in theirs.tied.items():
        if key not in out and twin in out:
            out[key] = out[twin]
    for key, tensor in theirs.tensors.items():
        if key not in out:
            raise KeyError(f"params have no value for the torch module's {key!r} {tensor.shape}")
        if out[key].shape != tensor.shape:
            raise ValueError(
                f"{key}: params give shape {out[key].shape}, the torch module has {tensor.shape}"
            )
    return {key: out[key] for key in theirs.tensors}


# ---- layouts ------------------------------------------------------------------------------


def _kernel_layout(
    key: str,
    shape: tuple[int, ...],
    jax_shape: tuple[int, ...],
    name: str,
    theirs: _Torch,
    layouts: Layouts,
) -> Layout:
    """A kernel's torch layout: its layer's, then ``layouts``', then its shape's if that
    tells it; a square kernel of none of them is refused."""
    known = theirs.layouts.get(key) or _named(layouts, key)
    if known:
        return known
    if jax_shape[-1] != jax_shape[-2]:
        return "out_in"  # the shape check tells it
    owner = theirs.unknown.get(key)
    told = f"its layer ({owner}) is none jaxdp knows" if owner else "a state_dict does not say"
    raise ValueError(
        f"state_dict[{key!r}] {tuple(shape)} for the square kernel {name} {jax_shape}: "
        f"its shape cannot tell nn.Linear's [out, in] from transformers' Conv1D's [in, out] "
        f"and {told}; pass the torch module (torch_to_params(model, like)) or "
        f"layouts={{{key!r}: 'out_in' or 'in_out'}} (layouts='out_in' for nn.Linear "
        "and nn.Conv layers only)"
    )


def _layout_hint(key: str, layout: Layout | None, theirs: _Torch) -> str:
    if layout is None or key in theirs.layouts:
        return ""
    other = "in_out" if layout == "out_in" else "out_in"
    return (
        f" (read as {layout!r}; if it is {other!r}, as transformers' Conv1D keeps GPT-2's "
        f"projections, pass the torch module or layouts={{{key!r}: {other!r}}})"
    )


def _named(layouts: Layouts, key: str) -> Layout | None:
    if isinstance(layouts, str):
        return layouts
    return None if layouts is None else layouts.get(key)


def _check_layouts(layouts: Layouts, tensors: Mapping[str, Any]) -> None:
    if layouts is None:
        return
    named = {"layouts": layouts} if isinstance(layouts, str) else layouts
    if not isinstance(named, Mapping):
        raise TypeError(f"layouts={layouts!r} must be 'out_in', 'in_out' or a dict of them")
    for key, layout in named.items():
        where = "layouts" if isinstance(layouts, str) else f"layouts[{key!r}]"
        if layout not in _LAYOUTS:
            raise ValueError(f"{where}={layout!r} must be one of {_LAYOUTS}")
        if not isinstance(layouts, str) and key not in tensors:
            raise ValueError(f"layouts names {key!r}, which is no tensor of the state_dict")


def _torch_axes(layout: Layout | None, ndim: int) -> tuple[int, ...]:
    """JAX's ``[*k, in, out]`` axes in torch's order: ``[out, in, *k]`` or ``[in, out, *k]``."""
    if layout is None or ndim < 2:
        return tuple(range(ndim))
    spatial = tuple(range(ndim - 2))
    return (ndim - 1, ndim - 2, *spatial) if layout == "out_in" else (ndim - 2, ndim - 1, *spatial)


# ---- stacks of layers -----------------------------------------------------------------------


def _layer_keys(
    key: str, tensors: Mapping[str, Any], name: str, shape: tuple[int, ...]
) -> list[str] | None:
    """The torch keys of a stacked leaf's layers, in order: ``blocks.0.fc.weight``,
    ``blocks.1.fc.weight``, ... for ``blocks.fc.weight`` (an ``nn.ModuleList`` of
    identical modules, stacked along the leaf's leading axis, as ``nnx.vmap`` and Linen's
    ``nn.scan`` make them). None: ``tensors`` numbers no layers for ``key``.

    Raises:
      ValueError: the torch layers are not numbered 0 to L - 1 for the leaf's L layers, or
        their tensors do not have one axis less than the leaf.
    """
    parts = key.split(".")
    for cut in range(1, len(parts)):
        pattern = re.compile(
            re.escape(".".join(parts[:cut])) + r"\.(\d+)\." + re.escape(".".join(parts[cut:]))
        )
        found = {int(m[1]): k for k in tensors if (m := pattern.fullmatch(k))}
        if not found:
            continue
        stack = shape[0] if shape else 0
        pattern_name = f"{'.'.join(parts[:cut])}.<i>.{'.'.join(parts[cut:])}"
        if sorted(found) != list(range(stack)):
            odd = sorted(set(found) ^ set(range(stack)))[0]
            which = found.get(odd, pattern_name.replace("<i>", str(odd)))
            problem = f"has no {which!r}" if odd not in found else f"{which!r} has no layer to fill"
            raise ValueError(
                f"the torch state_dict {problem}: the stacked parameter {name} of shape "
                f"{shape} holds {stack} layers along its leading axis, the torch module list "
                f"numbers {pattern_name} for layers {sorted(found)}"
            )
        for i, k in sorted(found.items()):
            if len(np.shape(tensors[k])) != len(shape) - 1:
                raise ValueError(
                    f"state_dict[{k!r}] has shape {tuple(np.shape(tensors[k]))}: layer {i} "
                    f"of the stacked parameter {name} of shape {shape} needs one axis less "
                    "than it (its leading axis is the layers')"
                )
        return [found[i] for i in range(stack)]
    return None


# ---- the torch side ----------------------------------------------------------------------


class _Torch(NamedTuple):
    """What the torch side says: its tensors, and what its module says of them."""

    tensors: dict[str, np.ndarray]  # by key, DDP's ``module.`` prefix dropped
    layouts: dict[str, Layout]  # the kernel layout of each weight a known layer owns
    unknown: dict[str, str]  # the class of each weight's owner of no known layout
    tied: dict[str, str]  # a key whose tensor is an earlier key's -> that key


def _read(source: Any) -> _Torch:
    """The tensors of a torch module or a state_dict, with the module's layouts."""
    is_module = hasattr(source, "state_dict") and hasattr(source, "named_modules")
    state_dict = source.state_dict() if is_module else source
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"source is a {type(source).__name__}, not a torch nn.Module or a state_dict"
        )
    tensors = {_strip_ddp(key): _to_numpy(value) for key, value in state_dict.items()}
    layouts, unknown = {}, {}
    if is_module:
        for path, module in source.named_modules():
            weight = _strip_ddp(f"{path}.weight" if path else "weight")
            if weight in tensors and kind(module) in _KIND_LAYOUT:
                layouts[weight] = _KIND_LAYOUT[kind(module)]
            elif weight in tensors:
                unknown[weight] = type(module).__name__
    return _Torch(tensors, layouts, unknown, tied_keys(state_dict))


def tied_keys(state_dict: Mapping[str, Any]) -> dict[str, str]:
    """Each key whose tensor is the same memory as an earlier key's -> that key."""
    first: dict[tuple, str] = {}
    tied = {}
    for key, value in state_dict.items():
        if not hasattr(value, "data_ptr"):  # numpy arrays from a file are never tied
            continue
        identity = (value.data_ptr(), tuple(value.shape), tuple(value.stride()))
        if identity in first:
            tied[_strip_ddp(key)] = first[identity]
        else:
            first[identity] = _strip_ddp(key)
    return tied


def _torch_key(path: tuple) -> str:
    *parents, leaf = (str(p) for p in path)
    return ".".join([*parents, _TORCH_NAME.get(leaf, leaf)])


def _strip_ddp(key: str) -> str:
    return key.removeprefix("module.")


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    return np.asarray(value)


# ---- the JAX side ------------------------------------------------------------------------


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

"""Weights from a user's torch model to their JAX port: by names and layer kinds, or a mapping.

Every tensor of the torch ``state_dict`` fills one or more JAX leaves (parameters and
batch statistics, named by dotted paths: :mod:`jaxdp.parity._frameworks`) through a
layout transform chosen from the torch layer that owns it. For a Flax port (NNX or
Linen):

==========================  ============================  ===========================
torch layer, tensor         JAX leaf                      transform
==========================  ============================  ===========================
Linear ``weight``           ``kernel``                    ``[out, in]`` -> ``[in, out]``
Conv1d/2d/3d ``weight``     ``kernel``                    ``[O, I, *k]`` -> ``[*k, I, O]``
transformers' Conv1D        ``kernel``                    none (``[in, out]``, GPT-2's
``weight``                                                projections)
LayerNorm, GroupNorm,       ``scale``                     none
RMSNorm, BatchNorm
``weight``
Embedding ``weight``        ``embedding``                 none
BatchNorm buffers           ``running_mean`` or ``mean``, none (``num_batches_tracked``
                            ``running_var`` or ``var``    is skipped if JAX has none)
MultiheadAttention          ``query``/``key``/``value``   split in three, ``[in, heads,
``in_proj_weight/bias``     ``.kernel``/``.bias``         head_dim]`` (nnx.MultiHeadAttention)
its ``out_proj``            ``out.kernel``/``out.bias``   ``[heads, head_dim, out]``
anything else               the same name                 none
==========================  ============================  ===========================

A tensor tied to another (GPT-2's ``lm_head.weight``, which is ``wte.weight``) may stay
unmapped: the port reads the one it ties to.

An equinox port keeps torch's names and layouts (``eqx.nn.Linear.weight`` is ``[out,
in]``, ``eqx.nn.Conv``'s ``[O, I, *k]``), except a convolution's ``bias`` (``[O]`` ->
``[O, 1, ...]``) and MultiheadAttention (``in_proj`` split into ``query_proj``,
``key_proj``, ``value_proj``; ``out_proj`` is ``output_proj``).

A ``mapping`` dict overrides these rules per torch name; a mapping function replaces
them. Comparisons happen in the JAX layout, under the JAX names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._convert import tied_keys
from ._frameworks import Framework, Leaf, framework_of
from ._layer_rules import Transform, candidates, kind, rule, same

Mapping_ = Mapping[str, Any] | Callable[[dict[str, np.ndarray]], dict[str, Any]] | None


@dataclasses.dataclass(frozen=True)
class Link:
    """One torch tensor filling ``jax`` leaves: ``to_jax(tensor)`` gives one array per leaf."""

    torch: str
    jax: tuple[str, ...]
    to_jax: Transform
    how: str  # the transform, for messages

    def values(self, tensor: np.ndarray) -> tuple[np.ndarray, ...]:
        out = self.to_jax(np.asarray(tensor))
        return tuple(out) if len(self.jax) > 1 else (out,)


@dataclasses.dataclass(frozen=True)
class WeightMap:
    """How a torch ``state_dict`` becomes the JAX model's leaves (dotted JAX paths)."""

    framework: Framework  # the port's library
    jax_leaves: dict[str, Leaf]  # JAX path -> its value, and whether it trains
    links: tuple[Link, ...] = ()
    function: Callable[[dict[str, np.ndarray]], dict[str, Any]] | None = None
    frozen: frozenset[str] = frozenset()  # JAX paths of torch tensors without requires_grad

    def to_jax(self, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The JAX leaves (dotted path -> array, JAX layout) from torch tensors."""
        tensors = {k: _numpy(v) for k, v in state_dict.items()}
        if self.function is not None:
            return {k: np.asarray(v) for k, v in self.function(tensors).items()}
        out = {}
        for link in self.links:
            if link.torch in tensors:
                out.update(zip(link.jax, link.values(tensors[link.torch]), strict=True))
        return out

    def torch_name(self, jax_path: str) -> str | None:
        """The torch tensor that fills ``jax_path`` (None under a mapping function)."""
        for link in self.links:
            if jax_path in link.jax:
                return link.torch
        return None

    @property
    def params(self) -> list[str]:
        """The JAX paths of parameters (the rest are batch statistics)."""
        return [p for p, leaf in self.jax_leaves.items() if leaf.param]

    def load(self, model: Any, state_dict: Mapping[str, Any], dtype: Any) -> Any:
        """A new model of ``model``'s structure with the torch values; floating leaves
        in ``dtype``, integer leaves (counters) in their own dtype."""
        return self.framework.load(model, self.to_jax(state_dict), dtype)


def jax_leaves(model: Any) -> dict[str, Leaf]:
    """Dotted path -> :class:`Leaf` of every parameter and batch statistic of a port
    (an NNX module, a bound Linen module or an equinox module)."""
    return _framework(model).leaves(model)


def _framework(model: Any) -> Framework:
    framework = framework_of(model)
    if framework is None:
        raise TypeError(
            f"jax_model is a {type(model).__name__}, not an nnx.Module, a bound Linen "
            "module (module.bind(variables)) or an equinox Module"
        )
    return framework


def build_weight_map(torch_model: Any, jax_model: Any, mapping: Mapping_ = None) -> WeightMap:
    """The :class:`WeightMap` of two models, checked: every torch tensor used, every JAX
    leaf filled, every shape right. Raises one ``ValueError`` listing every problem.
    ``jax_model``: an NNX module, a bound Linen module or an equinox module."""
    framework = _framework(jax_model)
    layout = framework.layout
    leaves = framework.leaves(jax_model)
    tensors = torch_model.state_dict()
    state_dict = {k: _numpy(v) for k, v in tensors.items()}
    tied = tied_keys(tensors)  # lm_head.weight that is wte.weight: the port ties them its own way
    frozen_torch = {n for n, p in torch_model.named_parameters() if not p.requires_grad}
    if callable(mapping):
        return _function_map(framework, mapping, state_dict, leaves, frozen_torch)
    if mapping is not None and not isinstance(mapping, Mapping):
        raise TypeError(f"mapping={mapping!r} must be None, a dict or a function")
    modules = dict(torch_model.named_modules())
    links, unmapped = [], []
    for name in state_dict:
        if mapping is not None and name in mapping:
            link = _user_link(name, mapping[name], modules, layout)
        else:
            link = _auto_link(name, modules, leaves, layout)
        if link is None and not (_skippable(name, modules) or name in tied):
            unmapped.append(name)
        elif link is not None and link.jax:  # () for a tensor the mapping leaves out
            links.append(link)
    problems = _check_links(links, unmapped, state_dict, leaves, modules, layout)
    if problems:
        raise ValueError(_mapping_error(problems))
    frozen = frozenset(p for link in links if link.torch in frozen_torch for p in link.jax)
    return WeightMap(framework, leaves, tuple(links), None, frozen)


def _auto_link(
    name: str, modules: dict[str, Any], leaves: dict[str, Leaf], layout: str
) -> Link | None:
    for paths, transform, how in candidates(name, modules, layout):
        if all(p in leaves for p in paths):
            return Link(name, paths, transform, how)
    return None


def _skippable(name: str, modules: dict[str, Any]) -> bool:
    # BatchNorm's counter matters only for momentum=None; flax's BatchNorm has none.
    owner_path, _, leaf = name.rpartition(".")
    return leaf == "num_batches_tracked" and kind(modules.get(owner_path)) == "batchnorm"


def _user_link(name: str, target: Any, modules: dict[str, Any], layout: str) -> Link:
    """A mapping entry: None (leave the tensor out), a JAX path (the layer's own
    transform), or ``(path or paths, transform)``."""
    if target is None:
        return Link(name, (), same, "left out")
    if isinstance(target, str):
        _, transform, how = rule(name, modules, layout)
        return Link(name, (target,), transform, how)
    if isinstance(target, tuple) and len(target) == 2 and callable(target[1]):
        paths = (target[0],) if isinstance(target[0], str) else tuple(target[0])
        return Link(name, paths, target[1], getattr(target[1], "__name__", "mapping's"))
    raise TypeError(
        f"mapping[{name!r}]={target!r} must be None, a JAX path, or (path or paths, transform)"
    )


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


# ---- checks ----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Problems:
    torch: list[str] = dataclasses.field(default_factory=list)  # tensors nothing takes
    jax: list[str] = dataclasses.field(default_factory=list)  # leaves nothing fills
    shapes: list[str] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.torch or self.jax or self.shapes)


def _check_links(
    links: list[Link],
    unmapped: list[str],
    state_dict: dict[str, np.ndarray],
    leaves: dict[str, Leaf],
    modules: dict[str, Any],
    layout: str,
) -> _Problems:
    problems = _Problems()
    for name in unmapped:
        tried = ", ".join(p for paths, _, _ in candidates(name, modules, layout) for p in paths)
        problems.torch.append(f"{name} {_shape(state_dict[name])}: no JAX leaf {tried}")
    filled: dict[str, str] = {}
    for link in links:
        for path in link.jax:
            if path not in leaves:
                problems.torch.append(f"{link.torch} -> {path}: the JAX model has no {path}")
            elif path in filled:
                problems.jax.append(f"{path}: filled by both {filled[path]} and {link.torch}")
            filled[path] = link.torch
        if all(p in leaves for p in link.jax):
            _check_shapes(link, state_dict[link.torch], leaves, problems)
    for path, leaf in leaves.items():
        if path not in filled:
            problems.jax.append(f"{path} {_shape(leaf.value)}: no torch tensor fills it")
    return problems


def _check_shapes(link: Link, tensor: np.ndarray, leaves: dict[str, Leaf], problems: _Problems):
    try:
        values = link.values(tensor)
    except Exception as e:  # noqa: BLE001 - a user's transform; its error goes in the list
        problems.shapes.append(f"{link.torch} {_shape(tensor)} -> {link.jax}: {link.how}: {e}")
        return
    for path, value in zip(link.jax, values, strict=True):
        want = _shape(leaves[path].value)
        if _shape(value) != want:
            problems.shapes.append(
                f"{link.torch} {_shape(tensor)} -> {path}: {link.how} gives "
                f"{_shape(value)}, the JAX leaf is {want}"
            )


def _mapping_error(problems: _Problems) -> str:
    count = len(problems.torch) + len(problems.jax) + len(problems.shapes)
    lines = [
        f"the torch model's state_dict and the JAX model's parameters do not map onto each "
        f"other ({count} problems); pass mapping= to say how (docs/check-your-port.md)"
    ]
    for title, items in (
        ("torch tensors no JAX leaf takes", problems.torch),
        ("JAX leaves no torch tensor fills", problems.jax),
        ("shapes that do not match", problems.shapes),
    ):
        if items:
            lines += [f"{title} ({len(items)}):", *(f"  - {item}" for item in items)]
    return "\n".join(lines)


class _Reads(dict):
    """A state_dict that records which tensors a mapping function reads."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        super().__init__(tensors)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> np.ndarray:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def _all(self) -> None:
        self.read.update(self.keys())

    def items(self):  # noqa: ANN201 - dict's own
        self._all()
        return super().items()

    def values(self):  # noqa: ANN201 - dict's own
        self._all()
        return super().values()


def _function_map(
    framework: Framework,
    function: Callable[[dict[str, np.ndarray]], dict[str, Any]],
    state_dict: dict[str, np.ndarray],
    leaves: dict[str, Leaf],
    frozen_torch: set[str],
) -> WeightMap:
    tensors = _Reads(state_dict)
    values = function(tensors)
    if not isinstance(values, Mapping):
        raise TypeError(f"mapping function returned {type(values).__name__}, not a dict")
    problems = _Problems()
    problems.torch += [
        f"{k} {_shape(v)}: never read" for k, v in state_dict.items() if k not in tensors.read
    ]
    problems.torch += [
        f"returned {k!r}: the JAX model has no such leaf" for k in values if k not in leaves
    ]
    for path, leaf in leaves.items():
        if path not in values:
            problems.jax.append(f"{path} {_shape(leaf.value)}: not returned")
        elif _shape(values[path]) != _shape(leaf.value):
            problems.shapes.append(
                f"{path}: the mapping gives {_shape(values[path])}, the JAX leaf is "
                f"{_shape(leaf.value)}"
            )
    if problems:
        raise ValueError(_mapping_error(problems))
    # A layout function takes ones to ones: a JAX parameter made only of the frozen
    # tensors' zeros is frozen.
    probe = function({k: np.full_like(v, k not in frozen_torch) for k, v in state_dict.items()})
    frozen = frozenset(p for p, leaf in leaves.items() if leaf.param and not np.any(probe[p]))
    return WeightMap(framework, leaves, (), function, frozen)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))

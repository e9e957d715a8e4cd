"""The JAX side of a port, whichever library it is written in: Flax NNX, Flax Linen or
equinox, read and written through one interface.

A leaf is named by its dotted path: NNX's attribute path (``block.fc.kernel``), a Linen
variable's path inside its collection (``fc1.kernel``; ``bn.mean`` of ``batch_stats``),
an equinox field path (``layers.0.weight``). Parameters are what trains (``nnx.Param``,
Linen's ``params``, equinox's floating arrays); the other leaves are batch statistics
(``nnx.BatchStat``, Linen's ``batch_stats``); Linen's other collections are constants,
neither compared nor filled.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from .._frozen import _named
from .._model_kinds import is_equinox, merge_equinox, split_equinox


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array of the port: its value, and whether it trains (else a batch statistic)."""

    value: Any
    param: bool


class Framework:
    """How compare_models reads, fills and runs a port of one library."""

    name = ""
    layout = "flax"  # the weight map's layer rules (jaxdp.parity._layer_rules)

    def leaves(self, model: Any) -> dict[str, Leaf]:
        """Dotted path -> :class:`Leaf` of every parameter and batch statistic."""
        raise NotImplementedError

    def load(self, model: Any, values: dict[str, np.ndarray], dtype: Any) -> Any:
        """A new model of ``model``'s structure holding ``values`` (every leaf's); floating
        leaves in ``dtype``, integer leaves (counters) in their own dtype."""
        raise NotImplementedError

    def apply(self, model: Any) -> tuple[Any, Callable[[Any, Any], Any]]:
        """``(params, forward)``: the parameters as a pytree and ``forward(params, x)``, the
        training-mode output, differentiable in ``params`` (batch statistics left as they are)."""
        raise NotImplementedError

    def __call__(self, model: Any, x: Any) -> Any:
        """The model's training-mode output on the batch ``x`` (what the loss reads)."""
        return model(x)

    def core_name(self, name: str) -> str:
        """The weight map's name of a leaf that jaxdp's step (its ``trainable`` paths, its
        parameter tree) names ``name``."""
        return name


def _cast(value: Any, current: Any, dtype: Any) -> jax.Array:
    kind = dtype if np.issubdtype(np.asarray(current).dtype, np.floating) else current.dtype
    return jnp.asarray(value, kind)


class _NNX(Framework):
    name = "NNX"

    def leaves(self, model: nnx.Module) -> dict[str, Leaf]:
        state = nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))
        return {
            _dotted(path): Leaf(var.get_value(), isinstance(var, nnx.Param))
            for path, var in nnx.to_flat_state(state)
        }

    def load(self, model: nnx.Module, values: dict[str, np.ndarray], dtype: Any) -> nnx.Module:
        graphdef, state, rest = nnx.split(model, nnx.Any(nnx.Param, nnx.BatchStat), ...)
        flat = [
            (path, var.replace(_cast(values[_dotted(path)], var.get_value(), dtype)))
            for path, var in nnx.to_flat_state(state)
        ]
        return nnx.merge(graphdef, nnx.from_flat_state(flat), rest)

    def apply(self, model: nnx.Module) -> tuple[Any, Callable[[Any, Any], Any]]:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return params, lambda p, x: nnx.merge(graphdef, p, rest)(x)


class _Linen(Framework):
    name = "Linen"
    # collection -> trains; other collections are constants, neither compared nor filled.
    COLLECTIONS = {"params": True, "batch_stats": False}

    def leaves(self, model: linen.Module) -> dict[str, Leaf]:
        _, variables = model.unbind()
        out: dict[str, Leaf] = {}
        for collection in self.COLLECTIONS:
            tree = variables.get(collection, {})
            for path, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
                name = ".".join(_named(path))
                if name in out:
                    raise ValueError(
                        f"jax_model's Linen variables name {name!r} in both 'params' and "
                        f"{collection!r}; compare_models names a leaf by its path alone"
                    )
                out[name] = Leaf(value, self.COLLECTIONS[collection])
        return out

    def load(self, model: linen.Module, values: dict[str, np.ndarray], dtype: Any) -> Any:
        module, variables = model.unbind()

        def fill(path: Any, current: Any) -> Any:
            collection, *rest = _named(path)
            if collection not in self.COLLECTIONS:
                return current
            return _cast(values[".".join(rest)], current, dtype)

        return module.bind(jax.tree_util.tree_map_with_path(fill, dict(variables)))

    def apply(self, model: linen.Module) -> tuple[Any, Callable[[Any, Any], Any]]:
        module, variables = model.unbind()
        rest = {k: v for k, v in variables.items() if k != "params"}

        def forward(params: Any, x: Any) -> Any:
            return linen_forward(module, {"params": params, **rest}, x)

        return variables["params"], forward

    def __call__(self, model: linen.Module, x: Any) -> Any:
        return model(x, **train_mode(model))

    def core_name(self, name: str) -> str:
        # jaxdp's step holds a Linen module's collections as attributes of an NNX module
        # (jaxdp._model_kinds.LinenModel): its parameters' paths start with "params".
        return name.removeprefix("params.")


def train_mode(module: linen.Module) -> dict[str, bool]:
    """``{"train": True}`` for a Linen module whose ``__call__`` takes ``train``, else ``{}``."""
    return {"train": True} if "train" in inspect.signature(module.__call__).parameters else {}


def linen_forward(module: linen.Module, variables: dict[str, Any], x: Any) -> Any:
    """An unbound Linen module's training-mode output; the batch statistics it writes are
    dropped (the variables passed in stay as they are)."""
    mutable = [k for k in variables if k != "params"]
    out = module.apply(variables, x, **train_mode(module), mutable=mutable or False)
    return out[0] if mutable else out


class _Equinox(Framework):
    name = "equinox"
    layout = "torch"

    def leaves(self, model: Any) -> dict[str, Leaf]:
        eqx = _equinox()
        params = eqx.filter(model, eqx.is_inexact_array)
        return {
            ".".join(_named(path)): Leaf(value, True)
            for path, value in jax.tree_util.tree_flatten_with_path(params)[0]
        }

    def load(self, model: Any, values: dict[str, np.ndarray], dtype: Any) -> Any:
        eqx = _equinox()

        def fill(path: Any, current: Any) -> Any:
            if not eqx.is_inexact_array(current):
                return current
            return _cast(values[".".join(_named(path))], current, dtype)

        return jax.tree_util.tree_map_with_path(fill, model)

    def apply(self, model: Any) -> tuple[Any, Callable[[Any, Any], Any]]:
        static, params = split_equinox(model)  # as jaxdp's step splits it
        return params, lambda p, x: jax.vmap(merge_equinox(static, p))(x)

    def __call__(self, model: Any, x: Any) -> Any:
        # equinox layers take one example: the port is mapped over the batch.
        return jax.vmap(model)(x)


NNX, LINEN, EQUINOX = _NNX(), _Linen(), _Equinox()


def _equinox() -> Any:
    import equinox

    return equinox


def framework_of(model: Any) -> Framework | None:
    """The library of a built port, None for anything else. A Linen module must be bound
    (``module.bind(variables)``)."""
    if isinstance(model, nnx.Module):
        return NNX
    if isinstance(model, linen.Module) and model.scope is not None:
        return LINEN
    if is_equinox(model):
        return EQUINOX
    return None


def _dotted(path: tuple) -> str:
    return ".".join(map(str, path))

"""Models of the other JAX libraries, trained as an NNX module or a pytree is.

- A Flax Linen module, given bound to its variables (``module.bind(variables,
  rngs=...)``), becomes a :class:`LinenModel`: an NNX module whose ``params``
  are ``nnx.Param``, whose ``batch_stats`` are ``nnx.BatchStat`` (carried and
  committed as NNX's are), whose other collections are constants and whose rngs
  are ``nnx.Rngs`` streams (re-keyed per micro-batch as NNX's are). ``loss_fn``
  gets the Linen module bound afresh on every micro-batch: ``batch_stats``
  mutable, each rng stream's key from jaxdp's per-device stream.
- An equinox module is split by ``eqx.partition(module, eqx.is_inexact_array)``:
  its inexact arrays train, the rest is static (:class:`EquinoxDef`). Its
  stateful layers (``eqx.nn.BatchNorm``, anything with an ``eqx.nn.StateIndex``)
  are refused: their state is threaded through the forward by the caller, and
  the step has no place for it.

equinox is never imported here: a model is an equinox module only if equinox was
imported to build it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx
from flax.nnx import bridge

_KINDS = {"params": nnx.Param, "batch_stats": nnx.BatchStat}


class LinenModel(nnx.Module):
    """A bound Flax Linen module held as an NNX module (see the module docstring)."""

    def __init__(self, bound: linen.Module):
        module, variables = bound.unbind()
        self.module = module
        variables = {name: dict(tree) for name, tree in variables.items()}
        if "batch_stats" in variables:
            # Linen keeps running statistics in float32 whatever the parameters' dtype,
            # and a float64 forward then writes float64: carried, they keep the wider.
            wide = jnp.result_type(*jax.tree.leaves(variables.get("params", {})), jnp.float32)
            variables["batch_stats"] = jax.tree.map(
                lambda x: x.astype(jnp.promote_types(x.dtype, wide)), variables["batch_stats"]
            )
        # Each collection an attribute: parameter paths read as Linen's, ("params", "fc1", ...).
        self.collection_names = tuple(variables)
        for name, tree in variables.items():
            setattr(self, name, nnx.data(jax.tree.map(_KINDS.get(name, nnx.Variable), tree)))
        keys = {name: lazy.as_jax_rng() for name, lazy in bound.scope.rngs.items()}
        self.rngs = nnx.Rngs(**keys) if keys else None

    def bound(self, *, train: bool) -> linen.Module:
        """The Linen module bound to the current values: for a training forward
        ``batch_stats`` mutable and rngs drawn from the streams."""
        variables = {
            name: jax.tree.map(lambda v: v.get_value(), getattr(self, name), is_leaf=_is_variable)
            for name in self.collection_names
        }
        if not train:
            return self.module.bind(variables)
        rngs = {name: stream() for name, stream in self.rngs.items()} if self.rngs else {}
        return self.module.bind(variables, rngs=rngs, mutable=["batch_stats"])

    def absorb(self, bound: linen.Module) -> None:
        """Takes the batch statistics a training forward of ``bound`` wrote."""
        written = bound.variables.get("batch_stats", {})
        jax.tree.map(
            lambda var, value: var.set_value(value.astype(var.get_value().dtype)),
            getattr(self, "batch_stats", {}),
            dict(written),
            is_leaf=_is_variable,
        )


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a jit-static graph
class EquinoxDef:
    """The static part of an equinox module (``eqx.partition``'s second half)."""

    static: Any


jax.tree_util.register_static(EquinoxDef)


def as_trainable(model: Any) -> Any:
    """``model`` as the step trains it: a bound Linen module as a :class:`LinenModel`;
    a Linen variables dict with other collections, or a stateful equinox module,
    refused."""
    if isinstance(model, linen.Module):
        if model.scope is None:
            raise TypeError(
                f"{type(model).__name__} is an unbound Flax Linen module: give step.init "
                "the module bound to its variables, module.bind(variables, rngs={'dropout': "
                "key}) (rngs for the streams its forward draws from)"
            )
        return LinenModel(model)
    if isinstance(model, Mapping) and "params" in model:
        others = sorted(k for k, v in model.items() if k != "params" and isinstance(v, Mapping))
        if others:
            raise TypeError(
                f"step.init got a Flax Linen variables dict with the collections {others} "
                "beside 'params': as a pytree they would all train as parameters. Give the "
                "module bound to them, step.init(module.bind(variables)): 'params' train, "
                "'batch_stats' are carried as batch statistics, the rest stays constant"
            )
    if is_equinox(model):
        _refuse_state(sys.modules["equinox"], model)
    return model


def is_equinox(model: Any) -> bool:
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(model, eqx.Module)


def split_equinox(model: Any) -> tuple[EquinoxDef, Any]:
    """``(EquinoxDef, params)``: the inexact arrays train, the rest is static."""
    import equinox as eqx

    params, static = eqx.partition(model, eqx.is_inexact_array)
    return EquinoxDef(static), params


def merge_equinox(graphdef: EquinoxDef, params: Any) -> Any:
    import equinox as eqx

    return eqx.combine(params, graphdef.static)


def _refuse_state(eqx: Any, model: Any) -> None:
    def stateful(x: Any) -> bool:
        return isinstance(x, eqx.nn.StateIndex)

    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=stateful)[0]
    where = [jax.tree_util.keystr(path) for path, x in found if stateful(x)]
    if where:
        raise TypeError(
            f"the equinox module has stateful layers (eqx.nn.StateIndex at {where}: "
            "eqx.nn.BatchNorm, SpectralNorm); their eqx.nn.State is threaded through the "
            "forward by the caller and jaxdp's step has no place for it. Use a stateless "
            "normalization (eqx.nn.LayerNorm, GroupNorm, RMSNorm), or BatchNorm in a Flax "
            "NNX or Linen model with make_train_step(batch_stats='local' or 'sync')"
        )


def is_linen_backed(module: Any) -> bool:
    """A module whose variables a Linen module reads: jaxdp's or flax's bridge."""
    return isinstance(module, (LinenModel, bridge.ToNNX))


def linen_batch_norms(mode: str | None, axis_name: str) -> Any:
    """A context in which every Linen ``BatchNorm`` follows ``mode``: ``"sync"`` sets
    its ``axis_name`` to the mesh axis, ``"local"`` refuses one that has another."""

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if isinstance(module, linen.BatchNorm) and context.method_name == "__call__":
            own = module.axis_name
            if mode == "local" and own is not None:
                raise ValueError(
                    f"Linen BatchNorm {module.path} has axis_name={own!r} (statistics "
                    "across devices) but batch_stats='local'; build it with axis_name=None "
                    "or use batch_stats='sync'"
                )
            if mode == "sync":
                if own not in (None, axis_name):
                    raise ValueError(
                        f"Linen BatchNorm {module.path} has axis_name={own!r}; with "
                        f"batch_stats='sync' it must be None or the mesh axis {axis_name!r}"
                    )
                # A Linen module is frozen; this bound copy lives for this call only.
                object.__setattr__(module, "axis_name", axis_name)
        return next_fun(*args, **kwargs)

    return linen.intercept_methods(interceptor)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)

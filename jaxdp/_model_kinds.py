"""Models of the other JAX libraries, trained as an NNX module or a pytree is.

- A Flax Linen module, given bound to its variables (``module.bind(variables,
  rngs=...)``), becomes a :class:`LinenModel`: an NNX module whose ``params``
  are ``nnx.Param``, whose ``batch_stats`` are ``nnx.BatchStat`` (carried and
  committed as NNX's are), whose other collections are constants and whose rngs
  are ``nnx.Rngs`` streams (re-keyed per micro-batch as NNX's are). ``loss_fn``
  gets the Linen module bound afresh on every micro-batch: ``batch_stats``
  mutable, each rng stream's key from jaxdp's per-device stream. Linen's own
  spellings of that inside ``loss_fn`` (``mutable=`` on a call, ``apply``) and a
  forward that draws from a stream ``bind`` was given no key for are refused with
  what to write instead (:meth:`LinenModel.habits`).
- An equinox module is split by ``eqx.partition(module, eqx.is_inexact_array)``:
  its inexact arrays train, the rest is static (:class:`EquinoxDef`). Its
  stateful layers (``eqx.nn.BatchNorm``, anything with an ``eqx.nn.StateIndex``)
  are refused: their state is threaded through the forward by the caller, and
  the step has no place for it; so is the ``(model, state)`` pair
  ``eqx.nn.make_with_state`` returns.

equinox is never imported here: a model is an equinox module only if equinox was
imported to build it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import errors, linen, nnx
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
        bound = self.module.bind(variables, rngs=rngs, mutable=["batch_stats"])
        # This copy lives for one micro-batch: its apply refuses mutable=, whose
        # updates loss_fn would drop (the running statistics would never move).
        object.__setattr__(bound, "apply", functools.partial(_apply_refusing_mutable, bound))
        return bound

    @contextlib.contextmanager
    def habits(self) -> Iterator[None]:
        """The context ``loss_fn`` runs in: Linen's habits that fail (or silently drop
        the statistics) under jaxdp's binding get an error saying what jaxdp does instead."""
        with linen.intercept_methods(_refuse_mutable_call):
            try:
                yield
            except errors.InvalidRngError as e:
                found = re.search(r'needs PRNG for "([^"]+)"', str(e))
                stream = found.group(1) if found else "dropout"
                given = f"rngs for {sorted(self.rngs.keys())}" if self.rngs else "no rngs"
                raise ValueError(
                    f"the Linen module's forward draws from the rng stream {stream!r} but "
                    f"step.init got it bound with {given}: bind it with a key for "
                    f"every stream it draws from, module.bind(variables, rngs={{{stream!r}: "
                    "key}); jaxdp then draws a key per device and micro-batch from it"
                ) from e

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
    if _is_equinox_pair(model):
        _refuse_state(sys.modules["equinox"], model[0], pair=True)
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


def _is_equinox_pair(model: Any) -> bool:
    """``eqx.nn.make_with_state``'s ``(model, state)``."""
    eqx = sys.modules.get("equinox")
    return (
        eqx is not None
        and isinstance(model, tuple)
        and len(model) == 2
        and isinstance(model[0], eqx.Module)
        and isinstance(model[1], eqx.nn.State)
    )


def _refuse_state(eqx: Any, model: Any, *, pair: bool = False) -> None:
    def stateful(x: Any) -> bool:
        return isinstance(x, eqx.nn.StateIndex)

    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=stateful)[0]
    where = [jax.tree_util.keystr(path) for path, x in found if stateful(x)]
    if where or pair:
        what = "the equinox module has stateful layers"
        if pair:
            what = "step.init got an equinox (model, eqx.nn.State) pair (eqx.nn.make_with_state)"
        raise TypeError(
            f"{what} (eqx.nn.StateIndex at {where}: "
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


def _apply_refusing_mutable(bound: linen.Module, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("mutable"):  # False (apply's default) or an empty list mutate nothing
        raise TypeError(
            f"loss_fn called {type(bound).__name__}.apply(..., mutable="
            f"{kwargs['mutable']!r}): jaxdp binds the module per micro-batch with "
            "'batch_stats' mutable and collects the updated statistics itself, and apply's "
            "updates would be dropped. Call the module given to loss_fn directly, "
            "model(x, train=True), without apply or mutable="
        )
    return type(bound).apply(bound, *args, **kwargs)


def _refuse_mutable_call(next_fun, args, kwargs, context):
    if "mutable" in kwargs and not _takes(next_fun, "mutable"):
        raise TypeError(
            f"loss_fn called {type(context.module).__name__}.{context.method_name}(..., "
            f"mutable={kwargs['mutable']!r}): jaxdp binds the module per micro-batch with "
            "'batch_stats' mutable and collects the updated statistics itself. Call the "
            "module given to loss_fn directly, model(x, train=True), without mutable="
        )
    return next_fun(*args, **kwargs)


def _takes(fun: Any, name: str) -> bool:
    try:
        parameters = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):  # no signature to read: let the call decide
        return True
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)

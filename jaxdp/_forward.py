"""What is trained: a plain parameter pytree, a Flax NNX module, a bound Flax Linen
module or an equinox module (:mod:`jaxdp._model_kinds`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from ._frozen import combine
from ._model_kinds import (
    EquinoxDef,
    LinenModel,
    as_trainable,
    is_equinox,
    merge_equinox,
    split_equinox,
)
from ._model_state import micro_key, reseed, split_state, written_batch_stats

LossReduction = Literal["mean", "weighted"]
"""``"mean"``: ``loss_fn`` returns a micro-batch mean, the step averages them;
``"weighted"``: ``loss_fn`` returns ``(loss_sum, count)``, the step divides the sums."""


def split_model(model: Any) -> tuple[Any, Any, Any]:
    """``(graphdef, params, model_state)``; graphdef is None for a plain pytree.

    For an NNX module (a bound Linen module as :class:`LinenModel`) the trainable
    part is its ``nnx.Param`` variables; every other variable (batch statistics,
    rng counters) is ``model_state``. An equinox module's graphdef is its static
    part (:class:`EquinoxDef`), its model_state None.
    """
    model = as_trainable(model)
    if isinstance(model, nnx.Module):
        graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
        return graphdef, params, model_state
    if is_equinox(model):
        return (*split_equinox(model), None)
    return None, model, None


def merge_model(graphdef: Any, params: Any, model_state: Any) -> Any:
    """Inverse of :func:`split_model`: a Linen model comes back bound to its variables."""
    if graphdef is None:
        return params
    if isinstance(graphdef, EquinoxDef):
        return merge_equinox(graphdef, params)
    model = nnx.merge(graphdef, params, model_state)
    return model.bound(train=False) if isinstance(model, LinenModel) else model


def loss_parts(
    loss_fn: Callable[..., Any],
    reduction: LossReduction,
    graphdef: Any,
    *,
    configure: Callable[[Any], None] | None = None,
    context: Callable[[], Any] = contextlib.nullcontext,
    with_rng: bool = False,
    has_aux: bool = False,
) -> Callable[..., tuple[jax.Array, tuple[jax.Array, Any, Any]]]:
    """``parts(params, batch, batch_stats, rngs, constants, rng) -> (value, (weight,
    new_batch_stats, aux))``, differentiable in params.

    ``mean``: ``loss_fn`` returns the micro-batch's mean loss; weight is 1, so
    the step averages micro-batch means (DDP's ``loss / accum_steps``).
    ``weighted``: ``loss_fn`` returns ``(loss_sum, count)``; the step divides
    the total sum by the total count over all micro-batches and devices. A
    negative count becomes a NaN weight, so the step's non-finite decision
    refuses the update (it would step up the gradient).
    For an NNX module, ``batch_stats``, ``rngs`` and ``constants`` are the
    groups of :func:`jaxdp._model_state.split_state` and ``configure`` adjusts the
    merged module (the BatchNorm mode) before ``loss_fn`` sees it, and ``loss_fn`` runs
    in ``context()`` (Linen BatchNorms' mode). A :class:`LinenModel` reaches
    ``loss_fn`` as its bound Linen module, an equinox module whole.
    ``with_rng``: ``loss_fn`` also gets the keyword ``rng``. ``has_aux``: it returns
    ``(loss, aux)`` (``loss`` as above), ``aux`` a pytree of numeric arrays that
    the step averages as it averages the loss (None without ``has_aux``).
    """

    def parts(params, batch, batch_stats, rngs, constants, rng):
        model = given = params
        nnx_module = graphdef is not None and not isinstance(graphdef, EquinoxDef)
        if isinstance(graphdef, EquinoxDef):
            model = given = merge_equinox(graphdef, params)
        elif nnx_module:
            # Fresh Variables (same arrays) in this trace, so the forward may write them.
            states = jax.tree.map(lambda x: x, (params, batch_stats, rngs, constants))
            model = given = nnx.merge(graphdef, *states)
            if configure is not None:
                configure(model)
            if isinstance(model, LinenModel):
                given = model.bound(train=True)
        habits = model.habits() if given is not model else contextlib.nullcontext()
        with context(), habits:
            out = loss_fn(given, batch, rng=rng) if with_rng else loss_fn(given, batch)
        if given is not model:
            model.absorb(given)
        if nnx_module:
            batch_stats = written_batch_stats(model, constants)
        out, aux = _split_aux(out, has_aux, reduction)
        if reduction == "mean":
            if isinstance(out, (tuple, list)):
                raise TypeError(
                    f"loss_fn returned a {type(out).__name__} of {len(out)} values with "
                    "loss_reduction='mean', which takes one scalar (the micro-batch's mean "
                    "loss): return the loss alone; (loss, aux) with has_aux=True to report "
                    "metrics; or (loss_sum, count) with loss_reduction='weighted'"
                )
            _check_scalar(out, "loss_fn's return value", reduction)
            return out, (jnp.ones([], out.dtype), batch_stats, aux)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "loss_fn must return a (loss_sum, count) tuple with "
                f"loss_reduction='weighted', got {_describe(out)}"
            )
        value, count = out
        if isinstance(value, (tuple, list)):
            raise TypeError(
                "loss_fn returned ((loss_sum, count), aux) without has_aux=True: pass "
                "has_aux=True to make_train_step to report aux"
            )
        _check_scalar(value, "loss_sum", reduction)
        _check_scalar(count, "count", reduction)
        count = jnp.asarray(count).astype(value.dtype)
        # A scalar select; the NaN reaches the all-reduced weight, loss and gradients.
        return value, (jnp.where(count < 0, jnp.nan, count), batch_stats, aux)

    return parts


def _split_aux(out: Any, has_aux: bool, reduction: str) -> tuple[Any, Any]:
    """``(loss part, aux)`` of ``loss_fn``'s return value; aux is None without ``has_aux``."""
    if not has_aux:
        return out, None
    if not (isinstance(out, tuple) and len(out) == 2):
        want = "(loss, aux)" if reduction == "mean" else "((loss_sum, count), aux)"
        raise TypeError(f"with has_aux=True loss_fn must return {want}, got {_describe(out)}")
    for path, leaf in jax.tree_util.tree_flatten_with_path(out[1])[0]:
        dtype = getattr(leaf, "dtype", None) or (type(leaf) in (int, float, bool) and "float")
        if not dtype or not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, bool)):
            where = jax.tree_util.keystr(path)
            raise TypeError(f"aux{where} must be a numeric array, got {_describe(leaf)}")
    return out


def check_aux(recorded: Any, aux: Any, *, recorded_at: str, lead: int = 0) -> None:
    """Raises ``ValueError`` unless ``aux``, one trace of ``loss_fn``'s, has the tree
    structure of ``recorded``, the aux the step holds sums or a report of, and leaf by
    leaf its shape past ``recorded``'s first ``lead`` axes (1 for a per-device block).

    Run while JAX traces, before the sums meet the new aux: a tree map would raise
    JAX's "pytree structure" error, which never says aux, and an add would broadcast a
    leaf of another shape. The dtype may change: the step keeps aux in the accumulator
    dtype. ``recorded_at`` says where the record comes from and what holds it.
    """
    if jax.tree.structure(recorded) == jax.tree.structure(aux):
        for (path, old), new in zip(_aux_shapes(recorded, lead), jax.tree.leaves(aux), strict=True):
            if jnp.shape(new) != old:
                raise ValueError(
                    f"has_aux=True: loss_fn's aux{jax.tree_util.keystr(path)} has shape "
                    f"{jnp.shape(new)} in this trace, where the step recorded shape {old} "
                    f"{recorded_at}; recorded aux: {_aux_names(recorded, lead)}. {_AUX_RULE}"
                )
        return
    old_names = {name for name, _ in _aux_leaves(recorded, lead)}
    new_names = {name for name, _ in _aux_leaves(aux, 0)}
    added, missing = sorted(new_names - old_names), sorted(old_names - new_names)
    change = "; ".join(
        f"{what}: {', '.join(names)}"
        for what, names in (("added", added), ("missing", missing))
        if names
    ) or (f"{jax.tree.structure(aux)} where the step recorded {jax.tree.structure(recorded)}")
    raise ValueError(
        f"has_aux=True: loss_fn's aux changed structure ({change}): this trace returned "
        f"{_aux_names(aux, 0)}, the step recorded {_aux_names(recorded, lead)} "
        f"{recorded_at}. {_AUX_RULE}"
    )


_AUX_RULE = (
    "aux must keep one structure, and each leaf one shape, for a run: the step adds it "
    "into sums of the recorded ones. Return every key on every call (e.g. zeros where a "
    "metric is absent), each leaf reduced to a shape that does not follow the batch size"
)


def _aux_shapes(tree: Any, lead: int) -> list[tuple[Any, tuple[int, ...]]]:
    """``(key path, shape)`` per leaf of ``tree``, its first ``lead`` axes dropped."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(path, tuple(jnp.shape(x))[lead:]) for path, x in leaves]


def _aux_leaves(tree: Any, lead: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"aux{jax.tree_util.keystr(p)}", s) for p, s in _aux_shapes(tree, lead)]


def _aux_names(tree: Any, lead: int, most: int = 8) -> str:
    """``{aux['abs']: (), aux['first']: (2,)}``: the leaves and their shapes, the first
    ``most`` of them."""
    leaves = _aux_leaves(tree, lead)
    if not leaves:
        return "no leaf"
    names = [f"{name}: {shape}" for name, shape in leaves[:most]]
    more = f" and {len(leaves) - most} more" if len(leaves) > most else ""
    return "{" + ", ".join(names) + more + "}"


def micro_forward(
    parts: Callable[..., Any],
    params: Any,
    mask: tuple[bool, ...],
    model_state: Any,
    step: jax.Array,
    *,
    axis_name: str,
    rng_seed: int | None,
    routing: Any = None,
) -> Callable[..., tuple[Any, jax.Array, jax.Array, Any]]:
    """``forward(trainable, micro_batch, batch_stats, micro_index, scale) -> (grads,
    value, weight, new_batch_stats, aux)`` on one device, differentiating ``trainable``
    only (frozen leaves come from ``params`` per ``mask``). ``scale`` multiplies
    the loss before differentiation, so value and gradients come out scaled
    without a pass over the gradients (the weight is returned unscaled).

    Randomness: every ``nnx.Rngs`` stream, and ``loss_fn``'s ``rng`` when
    ``rng_seed`` is set, is keyed by :func:`jaxdp._model_state.micro_key` of ``step``
    (updates applied so far), this device's mesh index and the micro-batch's
    index in its window.

    ``routing`` (:class:`jaxdp._pipeline.Routing`), where ``forward`` is called with
    ``route=True``: the stacks of layers go to ``loss_fn`` as
    :class:`jaxdp._layers.Stack` (with ``sums``, the window's gradient sums, when
    given), and their gradients come back reduced, as :func:`jaxdp.scan_layers`'
    backward sent them layer by layer.
    """
    _, rngs, constants = split_state(model_state)
    device = jax.lax.axis_index(axis_name)

    def forward(trainable, batch, batch_stats, index, scale, *, route=False, sums=None):
        seeded = reseed(rngs, step, device, index)
        rng = None
        if rng_seed is not None:
            rng = micro_key(jax.random.key(rng_seed), step, device, index)

        def objective(trainable, sinks=None):
            if sinks is not None:
                trainable = routing.hand(trainable, sums, sinks)
            full = combine(trainable, params, mask)
            value, aux = parts(full, batch, batch_stats, seeded, constants, rng)
            return value * scale.astype(value.dtype), aux

        if not route:
            (value, (weight, new_stats, aux)), grads = jax.value_and_grad(objective, has_aux=True)(
                trainable
            )
            return grads, value, weight, new_stats, aux
        (value, (weight, new_stats, aux)), (grads, sunk) = jax.value_and_grad(
            objective, argnums=(0, 1), has_aux=True
        )(trainable, routing.sinks(trainable))
        return routing.merge(grads, sunk), value, weight, new_stats, aux

    return forward


def _check_scalar(x: Any, what: str, reduction: str) -> None:
    shape = jnp.shape(x)
    if shape != ():
        raise ValueError(
            f"{what} must be a scalar with loss_reduction={reduction!r}, got shape "
            f"{shape}; reduce over the micro-batch inside loss_fn"
        )
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating) and what != "count":
        raise TypeError(f"{what} must be a floating-point scalar, got {jnp.result_type(x)}")


def _describe(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"one array of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__

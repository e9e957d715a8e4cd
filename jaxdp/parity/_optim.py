"""Optimizers in torch's terms, and the optax chains that update exactly as torch.optim."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from .._frozen import _named

Names = tuple[str, ...] | Callable[[str], bool]
"""A parameter group's members: dotted names, or a predicate on a dotted name."""


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """One of torch's parameter groups after the first (``optimizer.param_groups[1:]``):
    its parameters and the settings it overrides; ``torch_ref.ParamGroup``'s fields.

    ``params``: dotted names (a tuple) or a predicate ``name -> bool``. In a comparison
    (``compare_models``, ``compare_recorded``) they are torch's ``state_dict`` names and
    the port's optimizer gets the same leaves through the weight map; in
    :func:`optax_like_torch` alone, the dotted paths of the tree it updates (an NNX
    model's ``head.bias``). ``learning_rate``, ``weight_decay``: the group's own (None:
    the spec's). A group whose name set is empty is refused.
    """

    params: Names
    learning_rate: float | None = None
    weight_decay: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.params, (list, str)):  # a list from a config; a str is a slip
            names = (self.params,) if isinstance(self.params, str) else tuple(self.params)
            object.__setattr__(self, "params", names)
        names = self.params
        if not callable(names) and not (names and all(isinstance(n, str) for n in names)):
            raise ValueError(
                f"ParamGroup params={names!r} must be a non-empty tuple of dotted names or a "
                "predicate name -> bool"
            )
        for field in ("learning_rate", "weight_decay"):
            if getattr(self, field) is not None:
                _check(field, getattr(self, field), ">= 0 (or None)", lambda v: v >= 0)

    def holds(self, name: str) -> bool:
        """Whether the parameter named ``name`` is in this group."""
        return bool(self.params(name)) if callable(self.params) else name in self.params


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer in torch's terms; the fields of ``torch_ref.OptimConfig``.

    The fields are torch's first parameter group's, which holds every parameter that no
    group of ``groups`` holds (torch's ``param_groups[0]``); each :class:`ParamGroup`
    sets its own learning rate and weight decay (no decay on biases and norms: a group
    with ``weight_decay=0``). ``max_grad_norm``'s clip is over every group at once, as
    ``clip_grad_norm_(model.parameters())``.
    """

    name: Literal["sgd", "adamw"]
    learning_rate: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = None  # clip_grad_norm_ after the sync
    groups: tuple[ParamGroup, ...] = ()  # torch's param_groups[1:]

    def __post_init__(self) -> None:
        """Refuses what ``torch.optim`` refuses (a negative rate, momentum, decay or eps,
        betas outside [0, 1), Nesterov without momentum) and NaN or Inf anywhere, which
        torch takes and which turns the first step's parameters to NaN."""
        if self.name not in ("sgd", "adamw"):
            raise ValueError(f"optimizer name={self.name!r} must be 'sgd' or 'adamw'")
        for field in ("learning_rate", "momentum", "weight_decay", "eps"):
            _check(field, getattr(self, field), ">= 0", lambda v: v >= 0)
        for field in ("b1", "b2"):
            _check(field, getattr(self, field), "in [0, 1)", lambda v: 0 <= v < 1)
        if self.max_grad_norm is not None:
            _check("max_grad_norm", self.max_grad_norm, "> 0 (or None)", lambda v: v > 0)
        if self.nesterov and not self.momentum > 0:
            raise ValueError(
                f"nesterov=True needs momentum > 0, got momentum={self.momentum!r} "
                "(torch.optim.SGD refuses it too)"
            )
        groups = tuple(ParamGroup(**g) if isinstance(g, dict) else g for g in self.groups)
        object.__setattr__(self, "groups", groups)  # dicts from dataclasses.asdict
        for i, group in enumerate(groups):
            if not isinstance(group, ParamGroup):
                raise TypeError(f"groups[{i}]={group!r} must be a ParamGroup")
            if not callable(group.params):
                twice = [n for n in group.params if any(g.holds(n) for g in groups[:i])]
                if twice:
                    raise ValueError(
                        f"groups[{i}] holds {twice}, which an earlier group holds: torch "
                        "refuses a parameter in two groups"
                    )

    def group_of(self, name: str) -> int:
        """0 for the first group (the spec's own settings), ``i + 1`` for ``groups[i]``;
        the first group that holds ``name``."""
        return next((i + 1 for i, g in enumerate(self.groups) if g.holds(name)), 0)

    def settings(self, group: int) -> tuple[float, float]:
        """``(learning_rate, weight_decay)`` of group ``group`` (0: the spec's own)."""
        if group == 0:
            return self.learning_rate, self.weight_decay
        g = self.groups[group - 1]
        rate = self.learning_rate if g.learning_rate is None else g.learning_rate
        decay = self.weight_decay if g.weight_decay is None else g.weight_decay
        return rate, decay


def _check(field: str, value: object, rule: str, holds: Callable[[float], bool]) -> None:
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (real and math.isfinite(value) and holds(value)):
        raise ValueError(f"{field}={value!r} must be a finite number {rule}")


OPTIMIZERS = {
    "sgd_momentum": OptimizerSpec("sgd", 0.05, momentum=0.9),
    "sgd_nesterov_wd": OptimizerSpec("sgd", 0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adamw": OptimizerSpec("adamw", 1e-2, weight_decay=1e-2),
    # max_grad_norm below the models' initial gradient norms, so clipping acts.
    "adamw_clip": OptimizerSpec("adamw", 1e-2, weight_decay=1e-2, max_grad_norm=0.05),
}
"""The optimizers the parity matrix runs, by name, in torch's terms."""


def optax_like_torch(
    spec: OptimizerSpec, learning_rate: optax.ScalarOrSchedule | None = None
) -> optax.GradientTransformation:
    """The optax chain that updates exactly as ``torch.optim`` does for ``spec``.

    SGD: weight decay is added to the gradient BEFORE momentum (torch's order),
    no dampening. AdamW: decoupled decay, ``eps`` outside the square root.
    Clipping follows ``clip_grad_norm_``: scale ``min(1, max / (norm + 1e-6))``.
    ``learning_rate``: a schedule (or number) in place of ``spec.learning_rate``,
    read at optax's count of updates before this one, as a torch scheduler stepped
    after each ``optimizer.step()`` gives the rate of step ``i`` (AdamW's decay then
    scales with it, as torch's does).

    ``spec.groups``: ``optax.multi_transform`` of one such optimizer per group, each leaf
    labelled by the first group whose ``params`` hold its dotted path (``head.bias``; an
    ``nnx.Variable``'s ``value`` left out), the rest the first group's; the clip before
    it, over every leaf. A group's schedule is ``learning_rate`` times the group's rate
    over ``spec.learning_rate`` (torch's ``LambdaLR``: one factor for every group). A
    group of names none of the tree's leaves has is refused when the optimizer is
    initialized.
    """
    if not spec.groups:
        inner = _one_group(spec, spec.learning_rate if learning_rate is None else learning_rate)
    else:
        transforms = {
            group: _one_group(spec, _group_rate(spec, group, learning_rate), group)
            for group in range(len(spec.groups) + 1)
        }
        inner = optax.multi_transform(transforms, functools.partial(_labels, spec))
    if spec.max_grad_norm is None:
        return inner
    return optax.chain(clip_grad_norm_like_torch(spec.max_grad_norm), inner)


def _one_group(
    spec: OptimizerSpec, rate: optax.ScalarOrSchedule, group: int = 0
) -> optax.GradientTransformation:
    decay = spec.settings(group)[1]
    if spec.name == "sgd":
        return optax.chain(
            optax.add_decayed_weights(decay),
            optax.sgd(rate, momentum=spec.momentum or None, nesterov=spec.nesterov),
        )
    if spec.name == "adamw":
        return optax.adamw(
            rate, b1=spec.b1, b2=spec.b2, eps=spec.eps, eps_root=0.0, weight_decay=decay
        )
    # OptimizerSpec refuses other names
    raise ValueError(f"optimizer name={spec.name!r} must be 'sgd' or 'adamw'")


def _group_rate(
    spec: OptimizerSpec, group: int, schedule: optax.ScalarOrSchedule | None
) -> optax.ScalarOrSchedule:
    rate = spec.settings(group)[0]
    if schedule is None or rate == spec.learning_rate:
        return rate if schedule is None else schedule
    if spec.learning_rate == 0:
        raise ValueError(
            f"groups[{group - 1}] has learning_rate={rate} and the spec learning_rate=0: a "
            "schedule scales each group's rate by its rate over the spec's, so give the "
            "spec its base rate"
        )
    if not callable(schedule):
        return schedule * (rate / spec.learning_rate)
    return lambda count: schedule(count) * (rate / spec.learning_rate)


def _labels(spec: OptimizerSpec, params: Any) -> Any:
    """Each leaf's group (0 for the spec's own), by its dotted path."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    names = [leaf_name(path) for path, _ in leaves]
    for i, group in enumerate(spec.groups):
        if not callable(group.params) and not set(group.params) & set(names):
            raise ValueError(
                f"groups[{i}] holds {list(group.params)}, and the optimizer's tree has no "
                f"leaf of these names; its leaves: {names}"
            )
    return jax.tree_util.tree_map_with_path(lambda path, _: spec.group_of(leaf_name(path)), params)


def leaf_name(path: Sequence[Any]) -> str:
    """A tree path's dotted name: keys, attributes and indices joined by dots, an
    ``nnx.Variable``'s trailing ``value`` left out."""
    names = _named(tuple(path))
    if names and names[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
        names = names[:-1]
    return ".".join(names)


def clip_grad_norm_like_torch(max_norm: float) -> optax.GradientTransformation:
    """``torch.nn.utils.clip_grad_norm_``: multiply by ``min(1, max_norm / (norm + 1e-6))``.

    Unlike ``optax.clip_by_global_norm`` (``max_norm / norm``, no epsilon).
    """

    def update(updates, state, params=None):
        del params
        norm = optax.tree.norm(updates)
        coef = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
        return jax.tree.map(lambda g: g * coef.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def onecycle_like_torch(
    max_lr: float,
    total_steps: int,
    *,
    pct_start: float = 0.3,
    anneal_strategy: Literal["cos", "linear"] = "cos",
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> optax.Schedule:
    """The optax schedule of ``torch.optim.lr_scheduler.OneCycleLR`` (two phases, its
    defaults), read at optax's count of updates as torch's rate of that step.

    torch anneals from ``max_lr / div_factor`` up to ``max_lr`` until step
    ``pct_start * total_steps - 1`` and down to ``max_lr / div_factor /
    final_div_factor`` at step ``total_steps - 1``; ``optax.cosine_onecycle_schedule``
    peaks one step later and ends elsewhere (a port built on it is 0.5 relative off at
    the third step of ten). Computed in float64 under ``jax_enable_x64``. Only the rate:
    torch's ``cycle_momentum=True`` (its default) also cycles SGD's momentum or Adam's
    beta1, which this does not, so compare against ``OneCycleLR(...,
    cycle_momentum=False)``.
    """
    if anneal_strategy not in ("cos", "linear"):
        raise ValueError(f"anneal_strategy={anneal_strategy!r} must be 'cos' or 'linear'")
    if not (isinstance(total_steps, numbers.Integral) and total_steps >= 2):
        raise ValueError(f"total_steps={total_steps!r} must be an integer >= 2")
    if not 0 < pct_start < 1:
        raise ValueError(f"pct_start={pct_start!r} must be in (0, 1)")
    initial = max_lr / div_factor
    minimum = initial / final_div_factor
    up_end = float(pct_start * total_steps) - 1  # torch's phase boundaries
    down_end = float(total_steps - 1)

    def anneal(start: float, end: float, pct: jax.Array) -> jax.Array:
        if anneal_strategy == "cos":  # torch's _annealing_cos, in its order of operations
            return end + (start - end) / 2.0 * (jnp.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def schedule(count: jax.Array) -> jax.Array:
        step = jnp.asarray(count).astype(jnp.result_type(float))
        up = anneal(initial, max_lr, step / up_end)
        down = anneal(max_lr, minimum, (step - up_end) / (down_end - up_end))
        return jnp.where(step <= up_end, up, down)

    return schedule

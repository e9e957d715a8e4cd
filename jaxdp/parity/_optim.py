"""Optimizers in torch's terms, and the optax chains that update exactly as torch.optim."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer in torch's terms; the fields of ``torch_ref.OptimConfig``."""

    name: Literal["sgd", "adamw"]
    learning_rate: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = None  # clip_grad_norm_ after the sync

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
    """
    rate = spec.learning_rate if learning_rate is None else learning_rate
    if spec.name == "sgd":
        momentum = spec.momentum or None
        inner = optax.chain(
            optax.add_decayed_weights(spec.weight_decay),
            optax.sgd(rate, momentum=momentum, nesterov=spec.nesterov),
        )
    elif spec.name == "adamw":
        inner = optax.adamw(
            rate,
            b1=spec.b1,
            b2=spec.b2,
            eps=spec.eps,
            eps_root=0.0,
            weight_decay=spec.weight_decay,
        )
    else:  # OptimizerSpec refuses other names
        raise ValueError(f"optimizer name={spec.name!r} must be 'sgd' or 'adamw'")
    if spec.max_grad_norm is None:
        return inner
    return optax.chain(clip_grad_norm_like_torch(spec.max_grad_norm), inner)


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

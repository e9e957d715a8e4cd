"""Stage 3 of a step: the user's optimizer on the window's global sums, or the skip of a
non-finite update, on the logical arrays (outside the mesh map).

Every device computes the same, replicated; at ZeRO stages 1 and 2 each device
updates its block of every split leaf, with its block of the optimizer state, and XLA
(GSPMD) inserts what a transform that reads beyond an element needs (the scalar sums
of a global-norm clip, a trust ratio's norms, a factored moment's means). Then one
all-gather per parameter dtype returns the whole parameters (:meth:`ShardPlan.gather`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._model_state import from_wire
from ._reduce import Reduced
from ._shards import ShardPlan
from ._train_state import LastUpdate
from ._tuning import Tuning


class Update(NamedTuple):
    params: Any  # the trainable parameters after the step
    opt_state: Any
    batch_stats: Any  # the committed batch statistics after the step
    applied: jax.Array  # an update was applied (not skipped; on multisteps: the window ended)
    skipped: jax.Array  # an update was due but skipped: non-finite gradients or loss
    report: LastUpdate


def update(
    optimizer: optax.GradientTransformation,
    reduced: Reduced,
    trainable: Any,
    opt_state: Any,
    batch_stats: Any,
    *,
    plan: ShardPlan,
    tuning: Tuning,
    skip_nonfinite: bool,
) -> Update:
    """Applies ``optimizer`` to the mean of ``reduced``'s gradient sums, or skips: with
    ``skip_nonfinite``, a NaN or Inf in the gradients (by their norm), the loss or the
    batch statistics leaves parameters, optimizer state and statistics as they were.

    The finiteness is of all-reduced values, so every device decides the same; a
    NaN or Inf on any device, or an overflow of a sum, makes it non-finite.
    """
    weight = reduced.weight
    loss = reduced.loss_sum / weight.astype(reduced.loss_sum.dtype)
    grad_norm = jnp.sqrt(reduced.squares) / weight
    stats_ok = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(reduced.batch_stats)]
    finite = jnp.all(jnp.stack([jnp.isfinite(grad_norm), jnp.isfinite(loss), *stats_ok]))
    ok = finite if skip_nonfinite else jnp.ones([], bool)

    def apply(operands: tuple[Any, Any]) -> tuple[Any, Any]:
        params, opt_state = operands
        mine = plan.local(params)
        grads = tuning.mean(reduced.grads, weight, like=mine)
        updates, opt_state = optimizer.update(grads, opt_state, mine)
        return plan.gather(optax.apply_updates(mine, updates)), plan.constrain(opt_state)

    operands = (trainable, opt_state)
    if skip_nonfinite:
        like = jax.eval_shape(apply, operands)
        params, opt_state = tuning.skip(ok, apply, operands, like)
    else:
        params, opt_state = apply(operands)
    committed = from_wire(reduced.batch_stats, batch_stats)
    stats = jax.tree.map(lambda a, b: jnp.where(ok, a, b), committed, batch_stats)
    aux = jax.tree.map(lambda x: x / weight.astype(x.dtype), reduced.aux)
    return Update(params, opt_state, stats, ok, ~ok, LastUpdate(loss, grad_norm, finite, aux))

"""The training state and how one call of the step advances it."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ._accumulate import AccumState, Update, learning_rate
from ._model_state import split_state


class TrainState(NamedTuple):
    """Everything one optimizer step reads and writes.

    Replicated on every device, except the per-device accumulators of the
    ``multisteps`` path (``accum``, with each device's batch statistics of the
    open window, and the gradient sums, ``opt_state.acc_grads``), which carry a leading
    ``num_devices`` axis split over the mesh. ``model_state`` holds the
    committed batch statistics (device 0's in ``batch_stats="local"``) and the
    rng streams' initial keys.
    """

    step: jax.Array  # optimizer updates applied so far (skipped ones not counted)
    params: Any  # all parameters, frozen ones included
    opt_state: Any  # of the trainable parameters only
    accum: AccumState | None  # multisteps only
    graphdef: Any  # NNX graph definition (static), None for a plain pytree
    model_state: Any  # NNX non-parameter variables, None for a plain pytree
    skipped_steps: jax.Array  # updates skipped for NaN/Inf gradients or loss, in total
    consecutive_skips: jax.Array  # ... since the last applied update


class NonFiniteError(RuntimeError):
    """A run of at least ``max_consecutive_skips`` optimizer steps in a row had NaN
    or Inf gradients or loss.

    ``state`` is the state given to the call that raised (its batch was not
    used): parameters, optimizer and model state as after the last applied
    update, its ``consecutive_skips`` at or above the limit.
    """

    def __init__(self, message: str, state: TrainState):
        super().__init__(message)
        self.state = state


def advance(
    state: TrainState, update: Update, params: Any, accum: Any
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The state after one call and its metrics: ``update``'s optimizer state and batch
    statistics, the full ``params``, and the step and skip counters."""
    metrics = dict(update.metrics)
    lr = learning_rate(update.opt_state)
    if lr is not None:
        metrics["learning_rate"] = lr
    count = state.step.dtype
    consecutive = jnp.where(
        update.skipped,
        state.consecutive_skips + 1,
        jnp.where(update.applied, 0, state.consecutive_skips),
    ).astype(count)
    skipped = state.skipped_steps + update.skipped.astype(count)
    metrics.update(skipped=update.skipped, skipped_steps=skipped, consecutive_skips=consecutive)
    model_state = state.model_state
    if model_state is not None:
        _, rngs, constants = split_state(model_state)
        model_state = nnx.merge_state(update.batch_stats, rngs, constants)
    new = state._replace(
        step=state.step + update.applied.astype(count),
        params=params,
        opt_state=update.opt_state,
        accum=accum,
        model_state=model_state,
        skipped_steps=skipped,
        consecutive_skips=consecutive,
    )
    return new, metrics

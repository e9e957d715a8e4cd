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


def check_live(state: TrainState, name: str = "state", *, quick: bool = False) -> None:
    """Raises ``ValueError`` if buffers of ``state`` were deleted: donated to a step's call
    (``make_train_step(donate=True)``, the default) or deleted by hand.

    Passing such a state to a compiled step crashes the process on a multi-device
    mesh, and saving it fails deep inside the checkpointer; check before either.
    Every leaf is looked at (``is_deleted()``, no device read: about 2 µs a leaf).
    ``quick`` looks at the three step counters only, which every call donates
    with the rest (a state passed again has them deleted), and at every leaf
    only to report one that is: O(1), what :class:`TrainStep` runs per call.
    """
    if quick and not (
        _deleted(state.step) or _deleted(state.skipped_steps) or _deleted(state.consecutive_skips)
    ):
        return
    leaves = jax.tree_util.tree_leaves_with_path(state)
    dead = [path for path, leaf in leaves if _deleted(leaf)]
    if not dead:
        return
    advice = "pass the state the previous call returned, or build the step with donate=False"
    if len(dead) == len(leaves):
        raise ValueError(
            f"{name} was donated to an earlier call: its buffers are deleted "
            f"({len(dead)} of {len(leaves)} leaves); {advice}"
        )
    raise ValueError(
        f"{name}{jax.tree_util.keystr(dead[0])} and {len(dead) - 1} more of {name}'s "
        f"{len(leaves)} leaves are deleted (donated to an earlier call); {advice}"
    )


def _deleted(leaf: Any) -> bool:
    # A method lookup, not isinstance(leaf, jax.Array): an ABC check costs more than it.
    is_deleted = getattr(leaf, "is_deleted", None)
    return is_deleted is not None and is_deleted()


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

"""The training state: the records a step reads and writes, and the checks on them.

The bottom of the step's modules: records only, no step logic. A multisteps
window lives in ONE record, :class:`Window`; the optimizer state is the user's
optimizer's own, untouched (its leaves split over the mesh at ZeRO stages).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

import jax


class Report(NamedTuple):
    """What an optimizer step reports (``metrics``), also kept in the multisteps window so
    that every call of the next window reports it (those calls apply no update).

    Attributes:
      loss: the loss over the step's micro-batches and devices (``loss_reduction``).
      grad_norm: the global L2 norm of the mean gradients.
      finite: gradients, loss and batch statistics free of NaN and Inf.
      aux: ``loss_fn``'s aux averaged as the loss (``has_aux``; else None).
    """

    loss: jax.Array
    grad_norm: jax.Array
    finite: jax.Array
    aux: Any = None


class Window(NamedTuple):
    """An accumulation window: what the micro-batches since the last optimizer step
    added up. The ``multisteps`` path keeps the open one in ``TrainState.window``; the
    ``fused`` path carries one through its ``lax.scan`` within a call.

    In ``TrainState.window`` the sums are per device (a leading ``num_devices`` axis
    split over the mesh), except that at ZeRO stage 2 the gradient leaves split over
    the mesh hold the window's global sums (each device its block, reduce-scattered on
    every call).

    Attributes:
      grads: gradient sums in the accumulator dtype, the trainable leaves only.
      loss_sum: ``[num_devices]``: the loss sums (of micro-batch means, or of
        ``loss_sum`` with ``loss_reduction="weighted"``).
      weight: ``[num_devices]``: micro-batch weights (mean) or counts (weighted).
      batch_stats: ``[num_devices, ...]``: each device's running statistics in the window.
      position: int32, replicated: micro-batches in the window so far (0 at a step
        boundary).
      last: the last optimizer step's :class:`Report` (None inside a fused call).
      aux: ``[num_devices, ...]``: ``loss_fn``'s aux sums (``has_aux``; else None).
    """

    grads: Any
    loss_sum: jax.Array
    weight: jax.Array
    batch_stats: Any
    position: jax.Array
    last: Report | None
    aux: Any = None


class SkipCounts(NamedTuple):
    """The non-finite skip's counters (``Skips(nonfinite=True)``): replicated int32
    scalars, what ``optax.ApplyIfFiniteState`` counts for ``optax.apply_if_finite``, kept
    by the step for its own skip (which also leaves the batch statistics and the window's
    restart alone, so it is no optax wrapper). Also in every call's metrics.

    Attributes:
      skipped_steps: updates skipped for NaN or Inf gradients, loss or batch statistics,
        in total (optax's ``total_notfinite``).
      consecutive_skips: updates skipped since the last applied one (optax's
        ``notfinite_count``); :class:`jaxdp.SkipWatch` raises :class:`NonFiniteError`
        when it reaches ``Skips(max_consecutive=...)``.
    """

    skipped_steps: jax.Array
    consecutive_skips: jax.Array


@dataclasses.dataclass(frozen=True)
class LogicalShapes:
    """The model's own shapes of the leaves that ZeRO stage 3 holds padded
    (``StageLayout.pads``): static, part of the state's tree structure (no leaves), so a
    step retraces for another one. Checkpoints save and compare the state in these
    shapes (:mod:`jaxdp.checkpoint`).

    Attributes:
      params: per leaf of ``TrainState.params`` (``jax.tree.leaves`` order), the shape the
        model gave it where the state holds it padded with zeros along its split
        dimension to a multiple of the shard count, None where it holds it as it is.
      opt_state: the same per leaf of ``TrainState.opt_state``: the shape the optimizer's
        ``init`` gives it on the model's shapes, where the state holds it padded.
    """

    params: tuple[tuple[int, ...] | None, ...]
    opt_state: tuple[tuple[int, ...] | None, ...] = ()


jax.tree_util.register_static(LogicalShapes)


class TrainState(NamedTuple):
    """Everything one optimizer step reads and writes.

    Replicated on every device, except the window (see :class:`Window`) and,
    at ZeRO stages 1 and 2, the optimizer state's leaves that follow the
    parameters' shapes, each split over the mesh along one of its dimensions.
    ``model_state`` holds the committed batch statistics (device 0's in
    ``batch_stats="local"``) and the rng streams' initial keys.

    At ZeRO stage 3 the trainable parameters, the optimizer state's leaves and the
    window's gradient sums are split too, and a leaf no dimension of which the shard
    count divides rests padded with zeros to a multiple of it: ``logical`` holds the
    model's shapes of those leaves (None where nothing is padded), and
    :meth:`jaxdp.TrainStep.model` gives the model back in them.
    """

    step: jax.Array  # optimizer updates applied so far (skipped ones not counted)
    params: Any  # all parameters, frozen ones included
    opt_state: Any  # the user's optimizer's state, of the trainable parameters only
    window: Window | None  # multisteps only
    graphdef: Any  # NNX graph definition (static), None for a plain pytree
    model_state: Any  # NNX non-parameter variables, None for a plain pytree
    skips: SkipCounts  # the non-finite skip's counters
    logical: LogicalShapes | None = None  # stage 3: the padded parameters' own shapes

    @property
    def skipped_steps(self) -> jax.Array:
        """``skips.skipped_steps``: updates skipped for NaN or Inf, in total."""
        return self.skips.skipped_steps

    @property
    def consecutive_skips(self) -> jax.Array:
        """``skips.consecutive_skips``: updates skipped since the last applied one."""
        return self.skips.consecutive_skips

    @property
    def accum(self) -> Window | None:
        """Deprecated name of :attr:`window` (jaxdp 0.2)."""
        warnings.warn(
            "TrainState.accum is deprecated: the open window is TrainState.window "
            "(a jaxdp.Window) since jaxdp 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.window


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
    if quick and not (_deleted(state.step) or any(_deleted(x) for x in state.skips)):
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

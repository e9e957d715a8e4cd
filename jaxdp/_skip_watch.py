"""The host-side watch of a training loop: the skip limit and the calls in flight."""

from __future__ import annotations

import collections

import jax
import numpy as np

from ._train_state import NonFiniteError, TrainState

IN_FLIGHT = 2  # calls a loop may run ahead of the host


class SkipWatch:
    """What a training loop keeps on the host between calls of a :class:`TrainStep`.

    The step itself is state in, state out; this object is the one piece of
    host state next to it (``step.watch``), for two jobs:

    - ``limit`` (``max_consecutive_skips``): raise :class:`NonFiniteError`,
      before a call uses its batch, once the step has skipped ``limit``
      updates in a row for NaN or Inf gradients or loss;
    - ``bound``: never let more than ``IN_FLIGHT`` (2) calls run ahead of
      the host. On several CPU devices the collectives of queued steps share
      one thread pool, and dozens of them on 2 cores starved XLA's in-process
      all-reduce until its rendezvous timeout aborted the process.

    Both read the skip counter of the call two before the current one (a
    metric, never donated), which is usually done already, so the host is not
    synced every call; only when that counter shows the limit is the state
    given to the call read (waiting for the call just before), and the error
    comes at most two calls after the limit was reached. :meth:`check` reads a
    state at once: call it after a loop, or a limit reached by the last calls
    goes unreported. :meth:`reset` forgets the calls seen, for a new loop with
    another state.
    """

    def __init__(self, limit: int | None, *, bound: bool):
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit={limit!r} must be a positive integer or None")
        self.limit = limit
        self.bound = bound
        self._recent: collections.deque[jax.Array] = collections.deque(maxlen=IN_FLIGHT)

    @property
    def active(self) -> bool:
        """Whether the watch keeps anything (a limit, or the bound on calls in flight)."""
        return self.limit is not None or self.bound

    def before(self, state: TrainState) -> None:
        """Called before a step's call; raises :class:`NonFiniteError` if due."""
        if len(self._recent) < IN_FLIGHT:
            return
        older = int(np.asarray(self._recent.popleft()))  # a quarter of int()'s host time
        if self.limit is not None and older >= self.limit:
            self.check(state)

    def after(self, metrics: dict[str, jax.Array]) -> None:
        """Called with a call's metrics; keeps its skip counter (not read yet)."""
        if self.active:
            self._recent.append(metrics["consecutive_skips"])

    def check(self, state: TrainState) -> None:
        """Raises :class:`NonFiniteError` if ``state`` follows ``limit`` skipped updates
        in a row (a host read: it waits for the call that made ``state``)."""
        if self.limit is None:
            return
        skips = int(state.consecutive_skips)
        if skips >= self.limit:
            raise NonFiniteError(
                f"{skips} optimizer steps in a row had NaN or Inf gradients or loss (or a "
                f"negative count) and were skipped (max_consecutive_skips={self.limit}); "
                f"parameters and optimizer state are those of step {int(state.step)}, in this "
                "error's .state",
                state,
            )

    def reset(self) -> None:
        """Forgets the calls seen so far (a new loop, from another state)."""
        self._recent.clear()

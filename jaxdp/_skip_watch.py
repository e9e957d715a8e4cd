"""The host-side watches of a training loop, kept by :class:`jaxdp.TrainStep` between
calls: the skip limit and the calls in flight (:class:`SkipWatch`), and the micro-batch
size (:class:`ResizeWatch`)."""

from __future__ import annotations

import collections
import warnings

import jax
import numpy as np

from ._checks import is_integer
from ._layout import BatchSizes
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
        if limit is not None and (not is_integer(limit) or limit < 1):
            raise ValueError(f"limit={limit!r} must be a positive integer or None")
        self.limit = None if limit is None else int(limit)
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


class ResizeWatch:
    """The micro-batch size of a step's last call (host state, like :class:`SkipWatch`).

    A multisteps window keeps one batch identity: a call with another
    micro-batch size while a window is open raises, naming both sizes. The
    first change of the size at all is announced with a ``UserWarning``: the
    step compiles again and each update averages another number of samples.
    Costs a comparison of two integers per call; the open window's position
    (a device value) is read only when the size changes.
    """

    def __init__(self, path: str, accum_steps: int):
        self.path = path
        self.accum_steps = accum_steps
        self.last: int | None = None
        self.announced = False

    def before(self, state: TrainState, sizes: BatchSizes) -> None:
        size, last = sizes.micro_batch_size, self.last
        if last is None or size == last:
            self.last = size
            return
        if self.path == "multisteps":
            done = int(np.asarray(state.window.position.addressable_data(0)))
            if done:
                raise ValueError(
                    f"this call has micro_batch_size={size} ({sizes.describe()}), but the open "
                    f"accumulation window ({done} of accum_steps={self.accum_steps} "
                    f"micro-batches) started with micro_batch_size={last}: one update must "
                    f"not mix batch identities; finish the window with micro_batch_size={last} "
                    "and change the size between windows"
                )
        if not self.announced:
            self.announced = True
            warnings.warn(
                f"micro_batch_size changed from {last} to {size} ({sizes.describe()}): the "
                "step compiles again for the new shape, and each update now averages another "
                "number of samples (said once per step)",
                stacklevel=3,
            )
        self.last = size

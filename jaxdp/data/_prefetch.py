"""The loader's background stages: grain reads calls ahead on worker threads, one more
thread places them on the mesh, at most ``depth`` placed calls ahead of the step."""

from __future__ import annotations

import atexit
import functools
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

# How often a blocked stage looks whether the other side is gone: bounds how long a
# dead placement thread or a closed loop can go unnoticed, costs nothing while busy.
_POLL_S = 0.1
# How long ``close`` waits for the placement thread to finish the item in hand (one
# call's read and placement: milliseconds, unless a read hangs).
_JOIN_S = 30.0

# Every placement thread not yet closed. A daemon thread still inside JAX's C++ code
# (placing arrays) when the interpreter finalizes is unwound by force, and the C++
# runtime aborts the process: "FATAL: exception not rethrown", exit 134, in 7 of 20
# runs that broke out of a loop and exited. ``atexit`` stops and joins them first.
_RUNNING: weakref.WeakSet[Placed] = weakref.WeakSet()
# Every read in flight, on its daemon thread. The same abort threatens one still inside
# C++ code (Arrow, for a Hugging Face dataset) at finalization, so the exit hook waits
# for them, but only this long: a read that never returns must not hold the exit.
_READING: set[threading.Thread] = set()
_EXIT_READ_S = 2.0


class LoaderWorkerError(RuntimeError):
    """A loader worker ended without a batch or an ordinary exception (e.g. ``SystemExit``
    in a read): raised in the training loop instead of waiting for a batch forever."""


class LoaderTimeoutError(TimeoutError):
    """The loop waited longer than the loader's ``read_timeout_s`` for a batch."""


def read_ahead(
    read: Callable[[int], Any], start: int, stop: int, *, workers: int, closed: threading.Event
) -> Iterator[Any]:
    """``read(i)`` for ``i`` in ``[start, stop)``, in order, ``workers`` threads reading ahead.

    grain's ``MapDataset`` over the call indices, read through its thread pool: it keeps
    the order, reads at most ``workers`` calls ahead, and raises a read's exception at
    that call. Each read runs on a daemon thread of its own that grain's thread waits
    for until ``closed`` is set: a read that never returns then holds neither grain's
    pool (which Python joins at exit: a Ctrl-C'd loop would never exit) nor ``close``.
    """
    import grain

    dataset = grain.MapDataset.range(start, stop).map(functools.partial(_detached, read, closed))
    options = grain.ReadOptions(num_threads=workers, prefetch_buffer_size=workers)
    return iter(dataset.to_iter_dataset(options))


class _Closed(Exception):
    """A read abandoned because its iteration was closed (never reaches the loop)."""


def _detached(read: Callable[[int], Any], closed: threading.Event, call: int) -> Any:
    result: list[Any] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(read(call))
        except BaseException as e:  # raised in grain's thread below, as it was raised
            failure.append(e)
        finally:
            _READING.discard(threading.current_thread())

    thread = threading.Thread(target=run, name="jaxdp-data-read", daemon=True)
    _READING.add(thread)
    thread.start()
    while thread.is_alive():
        thread.join(_POLL_S)
        if closed.is_set() and thread.is_alive():
            raise _Closed(f"call {call} was being read when the iteration was closed")
    if failure:
        raise failure[0]
    return result[0]


class Placed:
    """Iterates ``place(item)`` for the items of ``items``, placed on a background thread.

    At most ``depth`` placed items wait for the consumer (double-buffered with
    ``depth=2``: the next call's arrays are on the devices while the step runs).
    An exception on the thread (a read's, a placement's) is raised by the
    consumer's next ``__next__``, as it was raised; a ``BaseException`` that is
    not an ``Exception`` (a worker's ``SystemExit``) as :class:`LoaderWorkerError`.
    ``close`` stops the thread and waits for it; an unclosed one is closed at
    interpreter exit.
    """

    def __init__(
        self,
        items: Iterator[Any],
        place: Callable[[Any], Any],
        *,
        depth: int,
        timeout: float | None = None,
        stuck: Callable[[], str] = lambda: "",
        stop: threading.Event | None = None,
    ):
        self._items, self._place = items, place
        self._timeout, self._stuck = timeout, stuck
        self._timed_out = False  # then ``close`` does not wait for a read known to hang
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
        # Set when the iteration ends or is closed; ``read_ahead``'s reads watch it too.
        self._stop = stop if stop is not None else threading.Event()
        self._closed = False  # by ``close``: the consumer's next ``__next__`` ends the loop
        # A daemon, so a loop that is never closed cannot keep the interpreter alive;
        # ``close`` (or the exit hook) joins it before the interpreter finalizes.
        self._thread = threading.Thread(target=self._run, name="jaxdp-data-place", daemon=True)
        self._thread.start()
        _RUNNING.add(self)

    def _run(self) -> None:
        try:
            for item in self._items:
                if self._stop.is_set() or not self._put(("item", self._place(item))):
                    return
            self._put(("end", None))
        except BaseException as e:  # forwarded to the consumer, whatever it is
            self._put(("error", e))
        finally:
            close = getattr(self._items, "close", None)
            if close is not None:
                close()

    def _put(self, entry: tuple[str, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._closed:
            # A deliberate close ends the loop as a closed generator does, with nothing
            # more handed out (the position stays at the last batch given).
            raise StopIteration
        waited = 0.0
        while True:
            try:
                kind, value = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise LoaderWorkerError(
                        "the loader's placement thread ended without a batch or an error"
                    ) from None
                waited += _POLL_S
                if self._timeout is not None and waited >= self._timeout:
                    self._timed_out = True
                    raise LoaderTimeoutError(
                        f"no batch after read_timeout_s={self._timeout:g}: {self._stuck()}. "
                        "The loop stops here, its position intact; a read that never returns "
                        "cannot be stopped, and is left on a daemon thread (it does not keep "
                        "the process from exiting)"
                    ) from None
        if kind == "item":
            return value
        self._stop.set()
        if kind == "end":
            raise StopIteration
        if isinstance(value, Exception):
            raise value
        raise LoaderWorkerError(
            f"a loader worker died: {type(value).__name__}: {value} (the loop stops here "
            "rather than wait for a batch that will not come)"
        ) from value

    def close(self, timeout: float = _JOIN_S) -> None:
        """Stops the background thread after the item in hand and waits for it to end.

        The thread waits for no read in flight (each runs on a daemon thread of its own,
        left behind if it hangs); one still running after ``timeout`` seconds (a
        placement that hangs) is left behind with a warning. The consumer's next
        ``__next__`` raises ``StopIteration``.
        """
        self._closed = True
        self._stop.set()
        _RUNNING.discard(self)
        if self._thread is threading.current_thread() or self._timed_out:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            warnings.warn(
                f"the loader's placement thread is still reading or placing a batch after "
                f"{timeout:g} s; it is left running",
                RuntimeWarning,
                stacklevel=2,
            )


@atexit.register
def _close_running() -> None:
    for placed in list(_RUNNING):
        placed.close()
    deadline = time.monotonic() + _EXIT_READ_S
    for thread in list(_READING):
        thread.join(max(0.0, deadline - time.monotonic()))

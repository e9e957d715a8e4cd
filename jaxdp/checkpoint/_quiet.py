"""Quiet after a failed orbax read or write: one error reported, not dozens of tracebacks."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any


def quiet_failed_read_noise() -> None:
    """Silences the aftermath of a failed orbax read or write (once per process).

    When one array of a restore (or save) fails, orbax's asyncio loop stops while
    tensorstore still completes the other reads and writes: each completion callback
    raises RuntimeError("Event loop is closed") as an unraisable exception, and
    asyncio logs every other failed read as "exception was never retrieved".
    Dozens of tracebacks after an error that is already reported; everything
    else still reaches the previous hook and the log.
    """
    if not isinstance(sys.unraisablehook, _QuietClosedLoop):
        sys.unraisablehook = _QuietClosedLoop(sys.unraisablehook)
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, _QuietUnretrievedReads) for f in log.filters):
        log.addFilter(_QuietUnretrievedReads())


class _QuietClosedLoop:
    def __init__(self, previous: Callable[[Any], Any]):
        self.previous = previous

    def __call__(self, unraisable: Any) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        self.previous(unraisable)


class _QuietUnretrievedReads(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        unretrieved = "exception was never retrieved" in message
        return not (unretrieved and ("orbax" in message or "tensorstore" in message))

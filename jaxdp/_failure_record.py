"""A rank's record of when its failure began, for ``jaxdp launch`` to name the rank
that failed first.

The launcher sees exits in the order it reaps them, which on a busy machine need
not be the order the ranks began to fail: a rank that calls ``sys.exit(3)`` and a
peer whose collective then fails (gloo's "Connection closed by peer") can end
within milliseconds of each other and be reaped either way round. So a rank notes
the moment its failure began, before it ends and before any peer can see it end:
``jaxdp/cli/_rank.py`` for a non-zero ``sys.exit`` or an uncaught exception,
:func:`jaxdp.initialize`'s excepthook, and ``jaxdp train``'s own early exit.

The file is ``JAXDP_FAILURE_FILE`` (one per rank and start, set by the launcher);
its one line is ``BEGAN STATUS``, ``BEGAN`` from :func:`time.monotonic`
(CLOCK_MONOTONIC on Linux: one clock for every process of the machine, where
``jaxdp launch``'s ranks run). The first record of a process stands.

Standard library only: ``jaxdp/cli/_rank.py`` loads this file by its path before
the rank's code runs, without importing jaxdp (and JAX).
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

ENV_FAILURE_FILE = "JAXDP_FAILURE_FILE"


class FailureRecord(NamedTuple):
    """When a rank's failure began, and the status it exits with."""

    began: float  # time.monotonic() when the failure reached the rank's entry point
    status: int  # the shell's status: 1 for an uncaught exception, a sys.exit's code


def record_failure(status: int) -> None:
    """Notes that this process began to fail now and will exit with ``status``.

    Does nothing without ``JAXDP_FAILURE_FILE``, for status 0, or when this process
    recorded a failure already. Never raises: without a record the launcher goes by
    the order in which it saw the exits.
    """
    began = time.monotonic()
    path = os.environ.get(ENV_FAILURE_FILE)
    if not path or status == 0 or os.path.exists(path):
        return
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            f.write(f"{began!r} {status}\n")
        os.replace(partial, path)  # whole or absent for the launcher's read
    except OSError:
        pass


def read_failure(path: os.PathLike[str] | str) -> FailureRecord | None:
    """The record at ``path``; None if there is none (or it does not parse)."""
    try:
        with open(path) as f:
            began, status = f.read().split()
        return FailureRecord(float(began), int(status))
    except (OSError, ValueError):
        return None

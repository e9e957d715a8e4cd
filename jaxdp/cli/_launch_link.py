"""What a rank tells ``jaxdp launch`` beside its exit: that it is alive, and when its
failure began. Standard library only: ``jaxdp/cli/_rank.py``, which runs every Python
rank, loads this file by its path before the rank's code runs, without importing
jaxdp (and JAX).

**Heartbeat.** ``_rank.py`` starts :func:`start_heartbeat` first thing when
``JAXDP_HEARTBEAT_FILE`` names a file (the launcher sets it): a daemon thread touches
it every second once the rank is up, and a modification time older than
``--hang-timeout-s`` means the process stopped answering (a SIGSTOP, a process frozen
in the kernel). It needs the GIL for microseconds, and a process that runs at all
runs it. Up means joined: JAX's distributed runtime started in the process (what
:func:`jaxdp.initialize` does), from when its peers can block waiting for it. Before,
the file does not exist and the launcher does not watch it: a rank still starting
(importing JAX on a loaded machine holds the GIL for seconds) is never called hung,
and a usage error it finds is its exit, not a hang verdict; JAX's own start-up
timeout covers a rank that never joins.

**Failure record.** The launcher reaps exits in the order it sees them, which on a
busy machine need not be the order the ranks began to fail: a rank that calls
``sys.exit(3)`` and a peer whose collective then fails (gloo's "Connection closed by
peer") can end within milliseconds of each other. So a rank notes the moment its
failure began (``_rank.py`` for a non-zero ``sys.exit`` or an uncaught exception,
``jaxdp train`` for its early exit) in
``JAXDP_FAILURE_FILE`` (one per rank and start): one line ``BEGAN STATUS``, ``BEGAN``
from :func:`time.monotonic` (one clock for every process of the machine). The first
record of a process stands.
"""

from __future__ import annotations

import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

ENV_FAILURE_FILE = "JAXDP_FAILURE_FILE"
ENV_HEARTBEAT_FILE = "JAXDP_HEARTBEAT_FILE"
INTERVAL_S = 1.0
_started: set[str] = set()
_lock = threading.Lock()


def start_heartbeat(path: str, *, up: Callable[[], bool] | None = None) -> None:
    """Touches ``path`` every :data:`INTERVAL_S` seconds from a daemon thread, from the
    first beat at which ``up()`` is true (default :func:`joined`) on (once per path and
    process)."""
    with _lock:
        if path in _started:
            return
        _started.add(path)
    file = pathlib.Path(path)
    is_up = up or joined

    def beat() -> None:  # ends with the process
        while not is_up():
            time.sleep(INTERVAL_S / 10)  # cheap: a dictionary lookup or two
        while True:
            try:
                os.utime(file)
            except OSError:
                file.touch()  # the first beat, or removed meanwhile
            time.sleep(INTERVAL_S)

    threading.Thread(target=beat, name="jaxdp-heartbeat", daemon=True).start()


def joined() -> bool:
    """Whether JAX's distributed runtime runs in this process (without importing JAX)."""
    jax = sys.modules.get("jax")
    try:
        return bool(jax is not None and jax.distributed.is_initialized())
    except Exception:  # JAX still being imported: not yet
        return False


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

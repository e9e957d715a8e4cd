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

**Joining.** A process that cannot join its run ends with one ``PROG: error:`` line
and status 2 (:func:`give_up`) instead of JAX's native abort (134 and a C++ stack),
for ``jaxdp train`` (:mod:`jaxdp.cli._join`) and for a script run by ``jaxdp launch``
(``_rank.py``): a process other than 0 first asks the coordinator's port what listens
there (:func:`check_coordinator`); one that has not joined at its deadline gives up
before JAX's own, which comes :data:`JAX_GRACE_S` later.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

ENV_FAILURE_FILE = "JAXDP_FAILURE_FILE"
ENV_HEARTBEAT_FILE = "JAXDP_HEARTBEAT_FILE"
INTERVAL_S = 1.0
# How long a process waits for what listens on the coordinator's port to answer as
# an HTTP/2 server. JAX's coordinator (gRPC) answers the client's preface in under a
# millisecond; seconds leave room for a loaded machine.
PROBE_S = 5.0
# JAX aborts a process that has not joined at its own deadline; a process that gives
# up (give_up) does so this much earlier.
JAX_GRACE_S = 5
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4  # the HTTP/2 frame type a server's preface begins with
_started: set[str] = set()
_lock = threading.Lock()


def start_heartbeat(path: str, *, up: Callable[[], bool] | None = None) -> None:
    """Touches ``path`` every :data:`INTERVAL_S` seconds from a daemon thread, from the
    first beat at which ``up()`` is true (default :func:`joined`) on (once per path and
    process), until :func:`stop_heartbeat`."""
    with _lock:
        if path in _started:
            return
        _started.add(path)
    file = pathlib.Path(path)
    is_up = up or joined

    def beat() -> None:  # ends with the process, or at stop_heartbeat
        while not is_up():
            time.sleep(INTERVAL_S / 10)  # cheap: a dictionary lookup or two
        while True:
            with _lock:
                if path not in _started:
                    return
                try:
                    os.utime(file)
                except OSError:
                    file.touch()  # the first beat, or removed meanwhile
            time.sleep(INTERVAL_S)

    threading.Thread(target=beat, name="jaxdp-heartbeat", daemon=True).start()


def stop_heartbeat(path: str) -> None:
    """Stops beating and removes ``path``: the launcher watches no file, so a process whose
    work is done is never called hung while it exits (JAX's shutdown barrier waits for
    slower peers, and on a loaded machine the beating thread may not run meanwhile)."""
    with _lock:
        _started.discard(path)
        with contextlib.suppress(OSError):
            os.unlink(path)


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


def run_of(env: os._Environ[str] | dict[str, str]) -> tuple[str, str] | None:
    """``(who, address)`` of a multi-process run that ``env``'s ``JAXDP_*`` settings name,
    ``who`` as ``"process 1 of 2"``; None for one process, a cluster's own settings, or a
    value :func:`jaxdp.initialize` refuses (it says why)."""
    address = env.get("JAXDP_COORDINATOR_ADDRESS", "")
    try:
        count, rank = int(env.get("JAXDP_NUM_PROCESSES", "")), int(env.get("JAXDP_PROCESS_ID", ""))
    except ValueError:
        return None
    if ":" not in address or count < 2 or not 0 <= rank < count:
        return None
    if not address.rsplit(":", 1)[1].isdigit():
        return None
    return f"process {rank} of {count}", address


def check_coordinator(address: str, who: str) -> None:
    """Raises ValueError if a program other than an HTTP/2 server listens on the
    coordinator's ``address``. Nothing listening is no error: process 0 may not be up."""
    host, port = address.rsplit(":", 1)
    try:
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S)
    except OSError:
        return  # not up yet (or unreachable): JAX's own wait decides
    with conn:
        try:
            conn.sendall(_PREFACE)
            answer = _read(conn, 9)
        except OSError as e:
            answer = f"({e.strerror or e})".encode()
    if len(answer) == 9 and answer[3] == _SETTINGS:
        return
    heard = "no answer" if not answer else f"the answer {answer[:16]!r}"
    raise ValueError(
        f"JAXDP_COORDINATOR_ADDRESS={address!r}: {who} found a program on port {port} that "
        f"is not JAX's coordinator ({heard} to an HTTP/2 preface in {PROBE_S:g} s); process "
        "0 cannot run the coordinator on a port in use: give every process the same free port"
    )


def _read(conn: socket.socket, size: int) -> bytes:
    """Up to ``size`` bytes: fewer when the peer closes or is silent for PROBE_S."""
    data = b""
    conn.settimeout(PROBE_S)
    try:
        while len(data) < size and (chunk := conn.recv(size - len(data))):
            data += chunk
    except TimeoutError:
        pass
    return data


def never_joined(who: str, address: str, timeout_s: int, source: str) -> str:
    """What a process that gave up joining says (``source``: where ``timeout_s`` came from)."""
    return (
        f"{who} waited {timeout_s} s ({source}) for all processes to join at "
        f"JAXDP_COORDINATOR_ADDRESS={address!r}, in vain: a process never started or died "
        "while starting, or the processes were given different addresses (each needs "
        "process 0's)"
    )


def give_up(prog: str, said: str) -> None:
    """Ends the process with one ``PROG: error:`` line and status 2, its failure recorded
    for ``jaxdp launch``; for a process that cannot join, before JAX's abort."""
    record_failure(2)  # for jaxdp launch: this process's failure began here
    print(f"{prog}: error: {said}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)

"""How ``jaxdp train`` joins a multi-process run: a clear end instead of JAX's abort.

A process of a run given by the ``JAXDP_*`` environment (``jaxdp launch``, or set
by hand) that cannot join ended in JAX's native abort (status 134 and a C++ stack)
once ``JAXDP_TIMEOUT_S`` passed: a process given a port where another program
listens (process 0 refuses such a port at once, the others waited), or processes
given different addresses. Here such a process ends with one ``jaxdp train:
error:`` line and status 2, as any usage error, before JAX's deadline:

- a process other than 0 first asks the coordinator's port what listens there; a
  program that does not answer as an HTTP/2 (gRPC) server within
  :data:`PROBE_S` seconds is not JAX's coordinator, and is refused at once;
- every process that has not joined after ``JAXDP_TIMEOUT_S`` seconds (default:
  jaxdp.initialize's) ends, naming who waited for what; JAX's own deadline is
  set :data:`JAX_GRACE_S` later, so that this end comes first.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from .._distributed import (
    DEFAULT_TIMEOUT_S,
    ENV_COORDINATOR_ADDRESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_TIMEOUT,
    initialize,
)
from ._launch_link import record_failure

# How long a process waits for what listens on the coordinator's port to answer as
# an HTTP/2 server. JAX's coordinator (gRPC) answers the client's preface in under a
# millisecond; seconds leave room for a loaded machine.
PROBE_S = 5.0
# JAX aborts the process at its own deadline; this end comes this much earlier.
JAX_GRACE_S = 5
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4  # the HTTP/2 frame type a server's preface begins with


def join(cpu_devices: int | None) -> None:
    """:func:`jaxdp.initialize` with ``cpu_devices``; a process that cannot join the run
    its ``JAXDP_*`` environment names raises ValueError (the coordinator's port held by
    another program) or ends with status 2 and one line (no peer joined in time)."""
    run = _run_settings()
    if run is None:  # one process, a cluster's own settings, or a setting initialize refuses
        initialize(cpu_devices=cpu_devices)
        return
    who, address, timeout_s, source = run
    if not who.startswith("process 0 "):
        check_coordinator(address, who)
    said = (
        f"{who} waited {timeout_s} s ({source}) for all processes to join at "
        f"{ENV_COORDINATOR_ADDRESS}={address!r}, in vain: a process never started or died "
        "while starting, or the processes were given different addresses (each needs "
        "process 0's); nothing was trained"
    )
    deadline = threading.Timer(timeout_s, _give_up, args=(said,))
    deadline.daemon = True
    deadline.start()
    try:
        initialize(cpu_devices=cpu_devices, timeout_s=timeout_s + JAX_GRACE_S)
    finally:
        deadline.cancel()


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
        f"{ENV_COORDINATOR_ADDRESS}={address!r}: {who} found a program on port {port} that "
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


def _run_settings() -> tuple[str, str, int, str] | None:
    """``(who, address, timeout_s, its source)`` of a multi-process run named by the
    ``JAXDP_*`` environment; None for anything else, or a value initialize refuses."""
    env = os.environ
    address = env.get(ENV_COORDINATOR_ADDRESS, "")
    try:
        count, rank = int(env.get(ENV_NUM_PROCESSES, "")), int(env.get(ENV_PROCESS_ID, ""))
        text = env.get(ENV_TIMEOUT, "")
        timeout_s = int(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        return None
    if ":" not in address or count < 2 or not 0 <= rank < count or timeout_s < 1:
        return None
    if not address.rsplit(":", 1)[1].isdigit():
        return None
    source = f"{ENV_TIMEOUT}={text!r}" if text else "jaxdp.initialize's default"
    return f"process {rank} of {count}", address, timeout_s, source


def _give_up(said: str) -> None:
    """Ends the process with one line and status 2, before JAX's abort."""
    record_failure(2)  # for jaxdp launch: this process's failure began here
    print(f"jaxdp train: error: {said}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)

"""How ``jaxdp train`` joins a multi-process run: a clear end instead of JAX's abort.

A process of a run given by the ``JAXDP_*`` environment (``jaxdp launch``, or set
by hand) that cannot join ended in JAX's native abort (status 134 and a C++ stack)
once ``JAXDP_TIMEOUT_S`` passed: a process given a port where another program
listens (process 0 refuses such a port at once, the others waited), or processes
given different addresses. Here such a process ends with one ``jaxdp train:
error:`` line and status 2, as any usage error, before JAX's deadline:

- a process other than 0 first asks the coordinator's port what listens there; a
  program that does not answer as an HTTP/2 (gRPC) server within
  :data:`~jaxdp.cli._launch_link.PROBE_S` seconds is not JAX's coordinator, and is
  refused at once;
- every process that has not joined after ``JAXDP_TIMEOUT_S`` seconds (default:
  jaxdp.initialize's) ends, naming who waited for what; JAX's own deadline is
  set :data:`~jaxdp.cli._launch_link.JAX_GRACE_S` later, so that this end comes first.

The same pieces (:mod:`jaxdp.cli._launch_link`) end a script's rank under ``jaxdp
launch`` alike (``_rank.py``).
"""

from __future__ import annotations

import os
import threading

from .._distributed import DEFAULT_TIMEOUT_S, ENV_TIMEOUT, initialize
from ._launch_link import JAX_GRACE_S, check_coordinator, give_up, never_joined, run_of


def join(cpu_devices: int | None) -> None:
    """:func:`jaxdp.initialize` with ``cpu_devices``; a process that cannot join the run
    its ``JAXDP_*`` environment names raises ValueError (the coordinator's port held by
    another program) or ends with status 2 and one line (no peer joined in time)."""
    run, timeout = run_of(os.environ), _timeout()
    if run is None or timeout is None:  # one process, a cluster's, or a value initialize refuses
        initialize(cpu_devices=cpu_devices)
        return
    (who, address), (timeout_s, source) = run, timeout
    if not who.startswith("process 0 "):
        check_coordinator(address, who)
    said = f"{never_joined(who, address, timeout_s, source)}; nothing was trained"
    deadline = threading.Timer(timeout_s, give_up, args=("jaxdp train", said))
    deadline.daemon = True
    deadline.start()
    try:
        initialize(cpu_devices=cpu_devices, timeout_s=timeout_s + JAX_GRACE_S)
    finally:
        deadline.cancel()


def _timeout() -> tuple[int, str] | None:
    """``JAXDP_TIMEOUT_S`` (or initialize's default) and where it came from; None for a
    value initialize refuses."""
    text = os.environ.get(ENV_TIMEOUT, "")
    if not text:
        return DEFAULT_TIMEOUT_S, "jaxdp.initialize's default"
    try:
        timeout_s = int(text)
    except ValueError:
        return None
    return (timeout_s, f"{ENV_TIMEOUT}={text!r}") if timeout_s >= 1 else None

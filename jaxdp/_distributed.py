"""Multi-process start-up: JAX's distributed runtime, then the global data mesh.

Every process of a run calls :func:`initialize` before any other JAX call.
The settings come from the arguments, else from the ``JAXDP_*`` environment
variables that ``jaxdp launch`` sets, else from JAX's own cluster detection
(Slurm, Open MPI, Kubernetes, Cloud TPU); with none of them it is one process
and nothing is started. The collectives are JAX's: NCCL between GPUs, gloo
between CPU processes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._checks import is_integer

if TYPE_CHECKING:
    from jax.sharding import Mesh

# JAX is imported where it is used: jaxdp launch reads the names of the settings here,
# and its process never needs JAX.

ENV_COORDINATOR_ADDRESS = "JAXDP_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXDP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDP_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAXDP_LOCAL_DEVICE_IDS"  # comma-separated GPU ids of this process
ENV_CPU_DEVICES = "JAXDP_CPU_DEVICES"
ENV_TIMEOUT = "JAXDP_TIMEOUT_S"
ENV_HEARTBEAT_TIMEOUT = "JAXDP_HEARTBEAT_TIMEOUT_S"
# Set by jaxdp launch: how many times the launcher restarted the group (0 at the
# first start; its heartbeat and failure files: jaxdp.cli._launch_link).
ENV_RESTART_COUNT = "JAXDP_RESTART_COUNT"
# Also set by jaxdp launch: when the launch began (time.time()), so that a restarted
# group's fresh start tells its earlier starts' outputs (written since) from another run's.
ENV_LAUNCH_STARTED = "JAXDP_LAUNCH_STARTED"
# Private to jaxdp launch's rank wrapper (jaxdp.cli._rank): seconds JAX's start-up
# deadline comes after timeout_s, so that the wrapper's end of a rank that cannot join
# (one line, status 2) comes before JAX's abort. Read once, and removed, by initialize.
ENV_JOIN_GRACE = "JAXDP_JOIN_GRACE_S"
# The name of the thread that lives while initialize waits for the run to join; it
# carries ``timeout_s`` and ``timeout_source``, for the rank wrapper's watchdog.
JOIN_THREAD_NAME = "jaxdp-join"

# JAX's own defaults are 300 s to start and 100 s of missed heartbeats; these
# end a job whose peer never started (JAX aborts ~5 s after the deadline), or
# died, within 2 minutes and about 1 minute.
DEFAULT_TIMEOUT_S = 100
DEFAULT_HEARTBEAT_TIMEOUT_S = 60

_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^\s:\[\]]+):(\d+)$")
_RUNTIME = ("coordinator_address", "num_processes", "process_id")


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    cpu_devices: int | None = None,
    timeout_s: int | None = None,
    heartbeat_timeout_s: int | None = None,
) -> Mesh:
    """Starts the distributed runtime if the run has several processes; returns the data mesh.

    Each setting is taken from its argument, else from its environment
    variable (``JAXDP_COORDINATOR_ADDRESS``, ``JAXDP_NUM_PROCESSES``,
    ``JAXDP_PROCESS_ID``, ``JAXDP_LOCAL_DEVICE_IDS``, ``JAXDP_CPU_DEVICES``,
    ``JAXDP_TIMEOUT_S``, ``JAXDP_HEARTBEAT_TIMEOUT_S``). What is still unset
    of address, count and id is left to ``jax.distributed.initialize``'s
    cluster detection (Slurm, Open MPI, Kubernetes, Cloud TPU). With none of
    the three set and no cluster detected, or a count of 1, the run is one
    process and nothing starts. If the runtime is already up, only the mesh
    is built. So is a process whose JAX backend already started when nothing
    asks for more than one process.

    Args:
      coordinator_address: ``host:port`` of process 0, where the coordinator
        listens; every process passes the same one.
      num_processes: processes in the run.
      process_id: this process, in ``[0, num_processes)``.
      local_device_ids: the GPUs this process drives (default: all visible).
      cpu_devices: CPU devices this process emulates (:func:`emulate_cpu_devices`).
      timeout_s: how long every process waits for all of them to connect, and at
        exit for all of them to finish (JAX's shutdown barrier); default 100.
      heartbeat_timeout_s: a process silent this long counts as dead, and JAX
        ends the others with an error naming it; default 60.

    Returns:
      ``data_mesh()``: every device of every process, ordered by process, so
      process ``p`` owns a contiguous block of data-parallel ranks.

    Nothing else of the process changes: its ``sys.excepthook``, signal
    handlers and file descriptors stay as they were. ``jaxdp launch`` does three
    things in each rank it runs (:mod:`jaxdp.cli._rank`): a rank that cannot join
    (another program on the coordinator's port, or ``timeout_s`` passed) ends with one
    line and status 2 before JAX's native abort (there JAX's start-up deadline comes
    5 s after ``timeout_s``: the private ``JAXDP_JOIN_GRACE_S``); a rank that fails
    (an uncaught exception, a non-zero ``sys.exit``) ends at once instead of
    waiting ``timeout_s`` in JAX's shutdown barrier while its peers block in a
    collective, and gloo's C++ connection note (``[Gloo] Rank 1 is connected
    to 3 peer ranks ...``) is kept out of its stdout. Without the launcher, a
    failing process ends after ``timeout_s`` and its peers
    ``heartbeat_timeout_s`` later (docs/scaling-out.md).

    Raises:
      ValueError: a setting is malformed or out of range (naming it and where it
        came from), or the runtime settings are incomplete.
      RuntimeError: JAX's backend already started in this process.
    """
    import jax

    from ._mesh import data_mesh, emulate_cpu_devices

    grace = os.environ.pop(ENV_JOIN_GRACE, "")  # not a user's setting: never refused
    s = _Settings()
    s.take("coordinator_address", coordinator_address, ENV_COORDINATOR_ADDRESS, str)
    s.take("num_processes", num_processes, ENV_NUM_PROCESSES, int)
    s.take("process_id", process_id, ENV_PROCESS_ID, int)
    s.take("local_device_ids", local_device_ids, ENV_LOCAL_DEVICE_IDS, _int_list)
    s.take("cpu_devices", cpu_devices, ENV_CPU_DEVICES, int)
    s.take("timeout_s", timeout_s, ENV_TIMEOUT, int, DEFAULT_TIMEOUT_S)
    s.take("heartbeat_timeout_s", heartbeat_timeout_s, ENV_HEARTBEAT_TIMEOUT, int)
    if s.values["heartbeat_timeout_s"] is None:
        s.values["heartbeat_timeout_s"] = DEFAULT_HEARTBEAT_TIMEOUT_S
    s.check()
    if s.values["cpu_devices"] is not None:
        emulate_cpu_devices(s.values["cpu_devices"])
    if not jax.distributed.is_initialized() and s.values["num_processes"] != 1:
        _start(s, grace_s=int(grace) if grace.isdigit() else 0)
    return data_mesh()


@dataclasses.dataclass
class _Settings:
    """Resolved settings, and where each came from (for error messages)."""

    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: dict[str, str] = dataclasses.field(default_factory=dict)

    def take(
        self, name: str, value: Any, env: str, parse: Callable[[str], Any], default: Any = None
    ) -> None:
        text = os.environ.get(env, "")
        if value is not None or not text:
            self.values[name] = default if value is None else value
            self.source[name] = f"{name}={self.values[name]!r}"
            return
        try:
            self.values[name] = parse(text)
        except ValueError:
            what = {int: "an integer", _int_list: "comma-separated integers"}.get(parse, "text")
            raise ValueError(f"{env}={text!r} must be {what} (jaxdp.initialize's {name})") from None
        self.source[name] = f"{env}={text!r}"

    def check(self) -> None:
        v, src = self.values, self.source
        for name in ("num_processes", "cpu_devices", "timeout_s", "heartbeat_timeout_s"):
            if v[name] is not None and (not is_integer(v[name]) or v[name] < 1):
                raise ValueError(f"{src[name]} must be a positive integer")
        pid, count = v["process_id"], v["num_processes"]
        if pid is not None and (not is_integer(pid) or pid < 0):
            raise ValueError(f"{src['process_id']} must be a non-negative integer")
        ids = v["local_device_ids"]
        if ids is not None and not all(is_integer(i) and i >= 0 for i in ids):
            raise ValueError(f"{src['local_device_ids']} must be non-negative integers")
        for name in ("num_processes", "process_id", "cpu_devices", "timeout_s"):
            if v[name] is not None:
                v[name] = int(v[name])
        v["heartbeat_timeout_s"] = int(v["heartbeat_timeout_s"])
        if ids is not None:
            v["local_device_ids"] = [int(i) for i in ids]
        if pid is not None and count is not None and pid >= count:
            raise ValueError(
                f"{src['process_id']} must be in [0, num_processes - 1] = [0, {count - 1}] "
                f"({src['num_processes']})"
            )
        address = v["coordinator_address"]
        if address is not None:
            match = _ADDRESS.match(address)
            if not match or not 0 < int(match.group(2)) < 65536:
                raise ValueError(
                    f"{src['coordinator_address']} must be host:port with a port in "
                    "[1, 65535], e.g. 10.0.0.1:1234 (process 0's address)"
                )

    def given(self) -> list[str]:
        return [self.source[n] for n in _RUNTIME if self.values[n] is not None]


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def _start(s: _Settings, *, grace_s: int) -> None:
    """``jax.distributed.initialize``, with a clear message if the peers never connect;
    JAX's deadline ``grace_s`` after ``timeout_s`` (0 but under ``jaxdp launch``)."""
    import jax

    v = s.values
    jax_timeout_s = v["timeout_s"] + grace_s
    who = "this process"
    if v["process_id"] is not None and v["num_processes"] is not None:
        who = f"process {v['process_id']} of {v['num_processes']}"
    where = v["coordinator_address"] or "the coordinator the cluster names"

    def report() -> None:
        # JAX aborts the process a few seconds after its deadline (a C++ fatal
        # error Python cannot catch); say first what most likely happened.
        print(
            f"jaxdp.initialize: {who} waited {v['timeout_s']} s ({s.source['timeout_s']}) for "
            f"all processes to connect to {where}, in vain: a process never started, died while "
            "starting, or cannot reach that address (process 0 runs the coordinator). "
            "JAX ends this process now.",
            file=sys.stderr,
            flush=True,
        )

    if v["process_id"] == 0 and v["coordinator_address"] is not None:
        _check_port_free(v["coordinator_address"], s.source["coordinator_address"])
    watchdog = _Joining(jax_timeout_s + 1, report, v["timeout_s"], s.source["timeout_s"])
    watchdog.start()
    try:
        jax.distributed.initialize(
            v["coordinator_address"],
            v["num_processes"],
            v["process_id"],
            local_device_ids=v["local_device_ids"],
            initialization_timeout=jax_timeout_s,
            heartbeat_timeout_seconds=v["heartbeat_timeout_s"],
            shutdown_timeout_seconds=v["timeout_s"],
        )
    except ValueError as e:
        # Raised before anything starts when JAX found no cluster to ask.
        if not s.given() and str(e).startswith("coordinator_address should be defined"):
            return
        given = ", ".join(s.given()) or "nothing"
        raise ValueError(
            f"jaxdp.initialize got {given} and no cluster filled in the rest ({e}); set "
            "coordinator_address, num_processes and process_id (or JAXDP_COORDINATOR_ADDRESS, "
            "JAXDP_NUM_PROCESSES, JAXDP_PROCESS_ID), or run under Slurm / Open MPI / Kubernetes"
        ) from None
    except RuntimeError as e:
        started = "before any JAX calls" in str(e)
        if started and not s.given():
            return  # JAX already runs here, as one process: nothing asked for more
        if started:
            raise RuntimeError(
                f"jaxdp.initialize must come before any other JAX call in the process ({e}); "
                "call it right after the imports"
            ) from None
        raise RuntimeError(
            f"jaxdp.initialize: {who} could not start JAX's distributed runtime with the "
            f"coordinator at {where} ({e}); is its port free on process 0?"
        ) from e
    finally:
        watchdog.cancel()


class _Joining(threading.Timer):
    """Reports (once ``interval`` passed) that the run never joined; alive, under the name
    :data:`JOIN_THREAD_NAME`, exactly while :func:`initialize` waits for the run to join.

    Attributes:
      timeout_s: the deadline initialize was given, before any launch's grace.
      timeout_source: where it came from, e.g. ``JAXDP_TIMEOUT_S='3'``.
    """

    def __init__(
        self, interval: float, report: Callable[[], None], timeout_s: int, timeout_source: str
    ) -> None:
        super().__init__(interval, report)
        self.name, self.daemon = JOIN_THREAD_NAME, True
        self.timeout_s, self.timeout_source = timeout_s, timeout_source


def _check_port_free(address: str, source: str) -> None:
    """Raises ValueError if process 0 cannot run the coordinator on ``address``'s port.

    JAX's coordinator (gRPC) binds ``[::]:port`` with SO_REUSEPORT; on a port taken
    by another program it crashed the process (status 139) after one log line.
    The same bind here fails on such a port but succeeds beside ``jaxdp launch``'s
    reservation (which sets SO_REUSEPORT and never listens); a connection that is
    accepted means another server, one with SO_REUSEPORT included, listens there.
    """
    port = int(address.rsplit(":", 1)[1])
    busy: str | None = None
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        if hasattr(socket, "SO_REUSEPORT"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind(("::", port))
        except OSError as e:
            busy = e.strerror
    if busy is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                busy = "another program listens there"
    if busy is not None:
        raise ValueError(
            f"{source}: process 0 runs the coordinator on port {port}, which is in use on "
            f"this machine ({busy}); choose a free port"
        )

"""``jaxdp launch``: one command as several processes of one JAX run, on this machine.

Each process gets the ``JAXDP_*`` environment that :func:`jaxdp.initialize`
reads (coordinator on a free local port, process count and id, its CPU device
count and GPU ids), runs in its own process group, and has its output prefixed
with ``[rank r]``. When one exits non-zero the others are stopped (SIGTERM,
then SIGKILL after a grace period, a short one when a signal killed it) and the
launcher exits with that status.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import IO, Any

from .._distributed import (
    ENV_COORDINATOR_ADDRESS,
    ENV_CPU_DEVICES,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_TIMEOUT,
)

DEFAULT_GRACE_S = 10.0
# The grace when a rank was killed by a signal. Its peers are then blocked in a
# collective that can never complete (a gloo all-reduce waits for every rank) and
# cannot act on SIGTERM; the second lets one that is not blocked exit on its own.
KILLED_PEER_GRACE_S = 1.0
_POLL_S = 0.05
# Signals that come from outside a process (a user, the OOM killer, a scheduler),
# never from its own reaction to a dead peer, unlike an error exit or SIGABRT.
_SENT_FROM_OUTSIDE = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def launch(
    command: Sequence[str],
    *,
    nprocs: int,
    devices_per_process: int | None = None,
    timeout_s: int | None = None,
    heartbeat_timeout_s: int | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    subcommands: Collection[str] = (),
    stdout: IO[bytes] | None = None,
    stderr: IO[bytes] | None = None,
) -> int:
    """Runs ``command`` as ``nprocs`` processes of one run; returns the exit status.

    ``command`` is a Python script (``x.py ...``, run with this interpreter),
    ``-m module ...``, ``jaxdp SUBCOMMAND ...`` or one of ``subcommands``
    (``train ...``: a jaxdp subcommand), or any other program. Process ``r``
    gets ``JAXDP_COORDINATOR_ADDRESS`` (127.0.0.1 and a free port),
    ``JAXDP_NUM_PROCESSES``, ``JAXDP_PROCESS_ID=r`` and, with
    ``devices_per_process=D``, ``JAXDP_CPU_DEVICES=D`` (D emulated CPU
    devices) and ``JAXDP_LOCAL_DEVICE_IDS`` (GPUs ``r*D .. r*D+D-1``);
    ``timeout_s`` and ``heartbeat_timeout_s`` go to :func:`jaxdp.initialize`
    the same way.

    Exit status: 0 when all exit 0. When one exits non-zero, the others get
    SIGTERM, then SIGKILL after ``grace_s`` seconds (after at most
    :data:`KILLED_PEER_GRACE_S` when a signal ended it: its peers are stuck in
    collectives that wait for it), and the status is that rank's (``128 + n``
    for a process ended by signal ``n``). A SIGINT or
    SIGTERM sent to the launcher is forwarded to every process and waited
    for; a second one kills them (status ``128 + signal``).
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r} must be a positive integer")
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"devices_per_process={devices_per_process!r} must be at least 1")
    if not 0 <= grace_s < float("inf"):  # NaN included
        raise ValueError(f"grace_s={grace_s!r} must be a finite number of seconds >= 0")
    for name, value in (("timeout_s", timeout_s), ("heartbeat_timeout_s", heartbeat_timeout_s)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer (seconds)")
    argv = child_argv(command, subcommands)
    out = stdout or sys.stdout.buffer
    err = stderr or sys.stderr.buffer
    group = _Group(out, err)
    with _reserved_port() as port, _Signals() as received:
        settings = {
            ENV_COORDINATOR_ADDRESS: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(nprocs),
        }
        if timeout_s is not None:
            settings[ENV_TIMEOUT] = str(timeout_s)
        if heartbeat_timeout_s is not None:
            settings[ENV_HEARTBEAT_TIMEOUT] = str(heartbeat_timeout_s)
        try:
            for rank in range(nprocs):
                env = {**os.environ, **settings, ENV_PROCESS_ID: str(rank)}
                env["PYTHONUNBUFFERED"] = "1"  # lines reach the prefixer as printed
                if devices_per_process is not None:
                    d = devices_per_process
                    env[ENV_CPU_DEVICES] = str(d)
                    env[ENV_LOCAL_DEVICE_IDS] = ",".join(str(rank * d + i) for i in range(d))
                group.start(rank, argv, env)
            return group.supervise(received, grace_s)
        finally:
            group.kill_all()


def child_argv(command: Sequence[str], subcommands: Collection[str] = ()) -> list[str]:
    """The argv each process runs for ``command`` (see :func:`launch`)."""
    command = list(command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ValueError("give the command to run after --, e.g. -- train --steps 5")
    if command[0] == "jaxdp":
        command = command[1:]
        if not command:
            raise ValueError("give the jaxdp subcommand to run, e.g. -- jaxdp train --steps 5")
    head = command[0]
    if head == "launch":
        raise ValueError("jaxdp launch cannot launch itself")
    if head in subcommands:
        return [sys.executable, "-m", "jaxdp", *command]
    if head == "-m" or head.endswith(".py"):
        return [sys.executable, *command]
    return command


class _Group:
    """The launched processes, their output pumps, and how they are stopped."""

    def __init__(self, out: IO[bytes], err: IO[bytes]):
        self.out, self.err = out, err
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pumps: list[threading.Thread] = []
        self.exits: list[tuple[int, int]] = []  # (rank, status) in the order they exited
        self.lock = threading.Lock()
        self.preexec = _die_with_launcher()

    def start(self, rank: int, argv: list[str], env: dict[str, str]) -> None:
        # A session of its own: signals reach it only through the launcher,
        # and killing its group also ends whatever it started.
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=self.preexec,
        )
        self.procs.append(proc)
        prefix = f"[rank {rank}] ".encode()
        for source, sink in ((proc.stdout, self.out), (proc.stderr, self.err)):
            pump = threading.Thread(target=self._pump, args=(source, sink, prefix), daemon=True)
            pump.start()
            self.pumps.append(pump)
        # A waiter per rank records exits in the order they happen: the rank
        # that failed first is named, not a peer that died of its failure.
        threading.Thread(target=self._wait, args=(rank, proc), daemon=True).start()

    def _wait(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        status = _status(proc.wait())
        with self.lock:
            self.exits.append((rank, status))

    def running(self) -> int:
        with self.lock:
            return len(self.procs) - len(self.exits)

    def _pump(self, source: IO[bytes], sink: IO[bytes], prefix: bytes) -> None:
        for line in iter(source.readline, b""):
            with self.lock:
                sink.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                sink.flush()
        source.close()

    def say(self, text: str) -> None:
        with self.lock:
            self.err.write(f"jaxdp launch: {text}\n".encode())
            self.err.flush()

    def supervise(self, received: list[int], grace_s: float) -> int:
        """Waits for all; stops the rest at the first failure. Returns the exit status."""
        failed: tuple[int, int] | None = None
        forwarded: int | None = None
        kill_at = float("inf")  # when the survivors get SIGKILL
        while self.running():
            if received and forwarded is None:
                forwarded = received[0]
                name = signal.Signals(forwarded).name
                self.say(f"{name}: forwarded to every rank (send it again to kill them)")
                self.signal_all(forwarded)
            if len(received) > 1:
                kill_at = min(kill_at, time.monotonic())
            if failed is None and forwarded is None:
                failed = self._first_failure()
                if failed is not None:
                    killed = failed[1] > 128  # the shell's status of a signal's victim
                    wait = min(grace_s, KILLED_PEER_GRACE_S) if killed else grace_s
                    self._report(failed, wait)
                    self.signal_all(signal.SIGTERM)
                    kill_at = time.monotonic() + wait
            if time.monotonic() >= kill_at:
                self.signal_all(signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(_POLL_S)
        for pump in self.pumps:
            pump.join(timeout=5)
        if failed is None and forwarded is None:
            failed = self._first_failure()  # all may have ended between two polls
            if failed is not None:
                self._report(failed, None)
        if failed is not None:
            rank, status = failed
            self.say(f"failed: rank {rank} exited with status {_describe(status)}")
            return status
        if forwarded is not None:
            return 128 + forwarded
        return 0

    def _report(self, failed: tuple[int, int], wait: float | None) -> None:
        rank, status = failed
        text = f"rank {rank} (pid {self.procs[rank].pid}) exited with status {_describe(status)}"
        if running := self.running():
            text += f"; stopping the other {running} rank(s)"
            if wait is not None:
                text += f" (SIGTERM, then SIGKILL after {wait:g} s)"
        self.say(text)

    def _first_failure(self) -> tuple[int, int] | None:
        """The rank that failed first among the exits seen so far.

        The waiter threads record exits in the order they get the GIL. On a busy
        machine the launcher may not run until a rank killed from outside and a
        peer that then exited with an error have both ended, in either order. A
        rank killed from outside cannot have died of a peer's failure, so among
        the exits seen together it is the cause; otherwise the earliest is.
        """
        with self.lock:
            failures = [(rank, status) for rank, status in self.exits if status != 0]
        killed = [failure for failure in failures if _sent_from_outside(failure[1])]
        if killed:
            return killed[0]
        return failures[0] if failures else None

    def signal_all(self, signum: int) -> None:
        for proc in self.procs:
            # The group may be gone already.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signum)

    def kill_all(self) -> None:
        """Leaves nothing running: SIGKILL to every group still there, then reap."""
        if any(p.poll() is None for p in self.procs):
            self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()


def _status(returncode: int) -> int:
    """The shell's status: ``128 + n`` for a process ended by signal ``n``."""
    return 128 - returncode if returncode < 0 else returncode


def _sent_from_outside(status: int) -> bool:
    return status - 128 in _SENT_FROM_OUTSIDE


def _describe(status: int) -> str:
    if status > 128:
        try:
            return f"{status} ({signal.Signals(status - 128).name})"
        except ValueError:
            pass
    return str(status)


def _die_with_launcher() -> Callable[[], None] | None:
    """On Linux, what a child runs before ``exec`` so that it gets SIGKILL if the
    launcher dies, however it dies (a SIGKILL, a crash): no rank outlives it.
    Elsewhere None: the launcher's own exit paths still stop every rank."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: the child only calls
    launcher = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher:  # it died before prctl took effect
            os._exit(1)

    return preexec


@contextlib.contextmanager
def _reserved_port() -> Iterator[int]:
    """A free local port, held while the launch runs so that nothing else takes it.

    A port found free and released before the coordinator binds it can be taken
    meanwhile (an ephemeral port of any connection). The socket holding it is
    bound with SO_REUSEPORT and never listens: JAX's coordinator (gRPC, which
    sets SO_REUSEPORT) binds the same port beside it and alone accepts
    connections, while any other bind of it fails.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if hasattr(socket, "SO_REUSEPORT"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


class _Signals:
    """Records SIGINT and SIGTERM instead of acting on them, while active."""

    def __enter__(self) -> list[int]:
        self.received: list[int] = []
        self.previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in self.previous:
            signal.signal(s, lambda signum, frame: self.received.append(signum))
        return self.received

    def __exit__(self, *exc: object) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def add_launch_command(sub: Any) -> None:
    """``jaxdp launch``: registered in ``jaxdp.cli._main.SUBCOMMANDS``."""
    p = sub.add_parser(
        "launch",
        help="run a script or jaxdp subcommand as several processes of one run",
        description="Starts --nprocs processes of the command after --, each with the "
        "environment jaxdp.initialize reads (coordinator on a free local port, process "
        "count and id, its devices), prefixes their output with [rank r], and stops all "
        "of them when one fails, exiting with its status. The command is a Python "
        "script, -m module, or a jaxdp subcommand (train ..., or jaxdp train ...).",
    )
    p.add_argument("--nprocs", type=int, required=True, metavar="N", help="processes to start")
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="D",
        help="CPU devices each process emulates, and GPUs each drives (r*D .. r*D+D-1) "
        "(default: not set; jaxdp train then emulates 4 CPU devices, and every process "
        "sees all GPUs)",
    )
    p.add_argument(
        "--timeout-s",
        type=int,
        default=None,
        metavar="SECONDS",
        help="seconds to wait for all processes to connect (default: jaxdp.initialize's 100)",
    )
    p.add_argument(
        "--heartbeat-timeout-s",
        type=int,
        default=None,
        metavar="SECONDS",
        help="seconds after which a silent process counts as dead (default: 60)",
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="after a failure, seconds between SIGTERM and SIGKILL",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    p.set_defaults(run=lambda args: _run_launch(args, set(sub.choices)))


def _run_launch(args: argparse.Namespace, subcommands: Collection[str]) -> int:
    try:
        return launch(
            args.command,
            nprocs=args.nprocs,
            devices_per_process=args.devices_per_process,
            timeout_s=args.timeout_s,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            grace_s=args.grace_s,
            subcommands=subcommands,
        )
    except ValueError as e:  # a usage error: exit status 2, as argparse's own
        print(f"jaxdp launch: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None

"""``jaxdp launch``: one command as several processes of one JAX run, on this machine.

Each process gets the ``JAXDP_*`` environment that :func:`jaxdp.initialize`
reads (coordinator on a free local port, process count and id, its CPU device
count and GPU ids, its restart count and heartbeat file), runs in its own
process group, and has its output prefixed with ``[rank r]``. When one exits
non-zero or stops answering, the others are stopped (:mod:`jaxdp.cli._group`),
and the group starts again, up to ``--max-restarts`` times (torchrun's meaning:
restarts of the whole group); past them the launcher exits with the last
failure's status.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Collection, Iterator, Sequence
from typing import IO

from .._checks import is_integer
from .._distributed import (
    ENV_COORDINATOR_ADDRESS,
    ENV_CPU_DEVICES,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_LAUNCH_STARTED,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_RESTART_COUNT,
    ENV_TIMEOUT,
)
from ._command import check_runnable, child_argv
from ._group import Failure, Group, Outcome
from ._interrupt import lend_sigint
from ._launch_link import ENV_FAILURE_FILE, ENV_HEARTBEAT_FILE

DEFAULT_GRACE_S = 10.0
# Half JAX's heartbeat timeout under jaxdp (60 s): the launcher names a stopped
# rank before JAX aborts its peers; far above a heartbeat thread's scheduling delay.
DEFAULT_HANG_TIMEOUT_S = 30.0


def launch(
    command: Sequence[str],
    *,
    nprocs: int,
    devices_per_process: int | None = None,
    timeout_s: int | None = None,
    heartbeat_timeout_s: int | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    max_restarts: int = 0,
    hang_timeout_s: float | None = DEFAULT_HANG_TIMEOUT_S,
    subcommands: Collection[str] = (),
    stdout: IO[bytes] | None = None,
    stderr: IO[bytes] | None = None,
) -> int:
    """Runs ``command`` as ``nprocs`` processes of one run; returns the exit status.

    ``command`` is a Python script (``x.py ...``, run with this interpreter),
    ``-m module ...``, ``jaxdp SUBCOMMAND ...`` or one of ``subcommands``
    (``train ...``: a jaxdp subcommand), or any other program on PATH. Process
    ``r`` gets ``JAXDP_COORDINATOR_ADDRESS`` (127.0.0.1 and a free port),
    ``JAXDP_NUM_PROCESSES``, ``JAXDP_PROCESS_ID=r``, ``JAXDP_RESTART_COUNT``
    (0, then 1 after the first restart, ...), ``JAXDP_LAUNCH_STARTED`` (when the
    launch began, ``time.time()``), ``JAXDP_HEARTBEAT_FILE``,
    ``JAXDP_FAILURE_FILE`` (:mod:`jaxdp.cli._launch_link`) and,
    with ``devices_per_process=D``, ``JAXDP_CPU_DEVICES=D`` (D emulated CPU
    devices) and ``JAXDP_LOCAL_DEVICE_IDS`` (GPUs ``r*D .. r*D+D-1``);
    ``timeout_s`` and ``heartbeat_timeout_s`` go to :func:`jaxdp.initialize`
    the same way. A Python rank's non-zero ``sys.exit`` ends it at once, and one
    that cannot join its run ends with one line and status 2 before JAX's abort
    (:mod:`jaxdp.cli._rank`).

    A rank fails when it exits non-zero or, once it joined the run (JAX's distributed
    runtime started in it, as :func:`jaxdp.initialize` does), leaves its heartbeat file
    untouched for ``hang_timeout_s`` (None: not watched); a rank still starting is never
    called hung. The rank named is the one whose failure began first
    (:func:`jaxdp.cli._group.first_to_fail`); a rank stopped by a signal while a peer
    failed is named, also unwatched. The others then get SIGTERM, then SIGKILL after
    ``grace_s`` seconds (after at most 1 s when a signal ended it, at once when it
    stopped answering: its peers are stuck in collectives that wait for it). The group
    then starts again, up to ``max_restarts`` times, each restart reported with its
    cause and downtime. Exit status: 0 when all exit 0; else the last failure's (``128 +
    n`` for a process ended by signal ``n``; 137 for a rank killed for not answering). A
    SIGINT or SIGTERM sent to the launcher is forwarded to every process and waited for,
    and never restarts the group; a second one kills them (status ``128 + signal``).
    Every rank is reaped, and what it left in its process group killed, before a start
    ends.
    """
    _check(
        nprocs,
        devices_per_process,
        grace_s,
        timeout_s,
        heartbeat_timeout_s,
        max_restarts,
        hang_timeout_s,
    )
    argv = child_argv(command, subcommands)
    check_runnable(argv)
    out = stdout or sys.stdout.buffer
    err = stderr or sys.stderr.buffer
    settings = {ENV_NUM_PROCESSES: str(nprocs), ENV_LAUNCH_STARTED: repr(time.time())}
    if timeout_s is not None:
        settings[ENV_TIMEOUT] = str(timeout_s)
    if heartbeat_timeout_s is not None:
        settings[ENV_HEARTBEAT_TIMEOUT] = str(heartbeat_timeout_s)
    with tempfile.TemporaryDirectory(prefix="jaxdp-launch-") as scratch, _Signals() as received:
        previous: Failure | None = None
        for restart in range(max_restarts + 1):
            # Each start's own heartbeat files and failure records.
            folder = pathlib.Path(scratch) / str(restart)
            folder.mkdir()
            group = Group(out, err, folder, watch=hang_timeout_s is not None)
            settings[ENV_RESTART_COUNT] = str(restart)
            outcome = _start(
                group,
                argv,
                settings,
                devices_per_process,
                received,
                grace_s,
                hang_timeout_s,
                previous,
                max_restarts,
            )
            failure = outcome.failure
            if failure is None or received or restart == max_restarts:
                if failure is not None:
                    used = f" ({restart} of --max-restarts {max_restarts} used)" * (
                        max_restarts > 0
                    )
                    group.say(f"failed: rank {failure.rank} {failure.cause}{used}")
                return outcome.status
            previous = failure
    raise AssertionError("unreachable: the last start returns")


def _start(
    group: Group,
    argv: list[str],
    settings: dict[str, str],
    devices_per_process: int | None,
    received: list[int],
    grace_s: float,
    hang_timeout_s: float | None,
    previous: Failure | None,
    max_restarts: int,
) -> Outcome:
    """Starts the group on a fresh port and supervises it to its end."""
    with _reserved_port() as port:
        try:
            for rank in range(int(settings[ENV_NUM_PROCESSES])):
                env = {**os.environ, **settings, ENV_PROCESS_ID: str(rank)}
                env[ENV_COORDINATOR_ADDRESS] = f"127.0.0.1:{port}"
                env["PYTHONUNBUFFERED"] = "1"  # lines reach the prefixer as printed
                if devices_per_process is not None:
                    d = devices_per_process
                    env[ENV_CPU_DEVICES] = str(d)
                    env[ENV_LOCAL_DEVICE_IDS] = ",".join(str(rank * d + i) for i in range(d))
                if (beat := group.heartbeat(rank)) is not None:
                    env[ENV_HEARTBEAT_FILE] = str(beat)
                env[ENV_FAILURE_FILE] = str(group.failure_file(rank))
                group.start(rank, argv, env)
            if previous is not None:
                down = time.monotonic() - previous.seen
                at = time.strftime("%H:%M:%S", time.localtime(previous.wall))
                group.say(
                    f"restart {settings[ENV_RESTART_COUNT]} of {max_restarts}: rank "
                    f"{previous.rank} {previous.cause} at {at}; the group was down {down:.1f} s"
                )
            return group.supervise(received, grace_s, hang_timeout_s)
        finally:
            group.kill_all()


def _check(
    nprocs: int,
    devices_per_process: int | None,
    grace_s: float,
    timeout_s: int | None,
    heartbeat_timeout_s: int | None,
    max_restarts: int,
    hang_timeout_s: float | None,
) -> None:
    if not is_integer(nprocs) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r} must be a positive integer")
    if devices_per_process is not None and (
        not is_integer(devices_per_process) or devices_per_process < 1
    ):
        raise ValueError(f"devices_per_process={devices_per_process!r} must be at least 1")
    if not 0 <= grace_s < float("inf"):  # NaN included
        raise ValueError(f"grace_s={grace_s!r} must be a finite number of seconds >= 0")
    for name, value in (("timeout_s", timeout_s), ("heartbeat_timeout_s", heartbeat_timeout_s)):
        if value is not None and (not is_integer(value) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer (seconds)")
    if not is_integer(max_restarts) or max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r} must be an integer >= 0")
    if hang_timeout_s is not None and not 0 < hang_timeout_s < float("inf"):
        raise ValueError(f"hang_timeout_s={hang_timeout_s!r} must be a finite number of seconds >0")


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
    """Records SIGINT and SIGTERM instead of acting on them, while active (the command's
    Ctrl-C lent to it: :mod:`jaxdp.cli._interrupt`)."""

    def __enter__(self) -> list[int]:
        self.received: list[int] = []
        self.lent = lend_sigint()
        self.lent.__enter__()
        self.previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in self.previous:
            signal.signal(s, lambda signum, frame: self.received.append(signum))
        return self.received

    def __exit__(self, *exc: object) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self.lent.__exit__(None, None, None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``jaxdp launch``'s options, added to its parser ``p`` (``jaxdp.cli._main.SUBCOMMANDS``)."""
    p.description = (
        "Starts --nprocs processes of the command after --, each with the "
        "environment jaxdp.initialize reads (coordinator on a free local port, process "
        "count and id, its devices), prefixes their output with [rank r], and stops all "
        "of them when one fails or stops answering; then starts them again, up to "
        "--max-restarts times, or exits with the failure's status. The command is a Python "
        "script, -m module, a jaxdp subcommand (train ..., or jaxdp train ...) or a program."
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
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="times to start the whole group again after a failure (torchrun's meaning); each "
        "start finds its count in $JAXDP_RESTART_COUNT, and jaxdp train resumes from its "
        "newest checkpoint (default: 0)",
    )
    p.add_argument(
        "--hang-timeout-s",
        type=float,
        default=DEFAULT_HANG_TIMEOUT_S,
        metavar="SECONDS",
        help="a Python rank whose heartbeat (a thread beating once the rank joined the run) is "
        "silent this long has stopped answering: the group is killed (default: "
        f"{DEFAULT_HANG_TIMEOUT_S:g}; 0 turns the watch off)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    p.set_defaults(run=_run_launch)


def _run_launch(args: argparse.Namespace) -> int:
    from ._main import SUBCOMMANDS  # the jaxdp subcommands a launch runs by their names

    try:
        hang = args.hang_timeout_s
        if not (hang == 0 or 0 < hang < float("inf")):  # NaN included
            raise ValueError(
                f"--hang-timeout-s {hang!r} must be a finite number of seconds > 0, or 0 to "
                "turn the watch off"
            )
        return launch(
            args.command,
            nprocs=args.nprocs,
            devices_per_process=args.devices_per_process,
            timeout_s=args.timeout_s,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            grace_s=args.grace_s,
            max_restarts=args.max_restarts,
            hang_timeout_s=args.hang_timeout_s or None,
            subcommands=set(SUBCOMMANDS),
        )
    except ValueError as e:  # a usage error: exit status 2, as argparse's own
        print(f"jaxdp launch: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None

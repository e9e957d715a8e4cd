"""One start of ``jaxdp launch``'s processes: their output, their exits, their
heartbeats, and how the group is stopped (:mod:`jaxdp.cli._launch` starts it again).

A rank is watched through its exit and, once it joined the run (JAX's distributed
runtime started in it, as :func:`jaxdp.initialize` does), through its heartbeat
file (:mod:`jaxdp.cli._launch_link`): a rank whose file has not been touched for the
hang timeout stopped answering (a SIGSTOP, a process frozen in the kernel), and the
group is killed. A rank stopped by a signal is found by its state in ``/proc`` too,
with or without the watch. The rank named as the failure is the one
whose failure began first (:func:`first_to_fail`), from the exits and the records
ranks leave when they begin to fail (:mod:`jaxdp.cli._launch_link`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, NamedTuple

from ._launch_link import FailureRecord, read_failure

# The grace when a rank was killed by a signal. Its peers are then blocked in a
# collective that can never complete (a gloo all-reduce waits for every rank) and
# cannot act on SIGTERM; the second lets one that is not blocked exit on its own.
KILLED_PEER_GRACE_S = 1.0
# A heartbeat older than this names its rank as the cause of a peer's failure
# (JAX's own heartbeat check aborting the peers of a stopped rank): the rank
# beats every second, so five missed beats are no scheduling delay.
STALE_S = 5.0
# After the first error exit it sees, how long the launcher waits for every other
# rank to end or record a failure before it names the first. A rank records its
# failure before it ends, so a peer that died of it can only record later; the wait
# is for two ranks failing on their own at about the same time, and costs nothing
# when every rank has ended or recorded (the peers of a JAX rank fail within
# milliseconds of its end: their collective's connection closes).
RECORD_WAIT_S = 0.5
_POLL_S = 0.05
# Signals that come from outside a process (a user, the OOM killer, a scheduler),
# never from its own reaction to a dead peer, unlike an error exit or SIGABRT.
_SENT_FROM_OUTSIDE = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_STATES = {"T": "stopped by a signal", "t": "stopped by a debugger", "D": "waiting on the kernel"}


class Failure(NamedTuple):
    """The rank that failed first in a start of the group, and how."""

    rank: int
    status: int  # the shell's status: 128 + n for signal n
    cause: str  # "exited with status 137 (SIGKILL)", "stopped answering: ..."
    seen: float  # time.monotonic() when the launcher saw it
    wall: float  # time.time() of the same moment


class Exit(NamedTuple):
    """A rank's end, as the launcher saw it."""

    rank: int
    status: int  # the shell's status: 128 + n for signal n
    seen: float  # time.monotonic() when the launcher saw it (after the end itself)
    # Ended by the signal itself, not exiting with 128 + n (as jaxdp train does after it
    # stopped on SIGTERM, or because a peer did)
    killed: bool = False


class Outcome(NamedTuple):
    """How a start of the group ended."""

    status: int  # the launcher's exit status if it ends here
    failure: Failure | None
    forwarded: int | None  # a signal the launcher got and passed on


class Group:
    """The launched processes, their output pumps, and how they are stopped."""

    def __init__(self, out: IO[bytes], err: IO[bytes], folder: pathlib.Path, *, watch: bool = True):
        self.out, self.err = out, err
        self.folder = folder  # this start's heartbeat files and failure records
        self.watch = watch  # whether heartbeats are watched
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pumps: list[threading.Thread] = []
        self.exits: list[Exit] = []  # in the order the launcher saw them
        self.lock = threading.Lock()
        self.preexec = _die_with_launcher()

    def heartbeat(self, rank: int) -> pathlib.Path | None:
        return self.folder / f"rank-{rank}" if self.watch else None

    def failure_file(self, rank: int) -> pathlib.Path:
        return self.folder / f"rank-{rank}.failed"

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
        try:
            status, killed = _wait_unreaped(proc)
        except ChildProcessError:  # reaped by kill_all after the start ended
            return
        with self.lock:
            self.exits.append(Exit(rank, status, time.monotonic(), killed))

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

    def supervise(
        self, received: list[int], grace_s: float, hang_timeout_s: float | None
    ) -> Outcome:
        """Waits for all; stops the rest at the first failure or silent rank."""
        failed: Failure | None = None
        forwarded: int | None = None
        kill_at = float("inf")  # when the survivors get SIGKILL
        while self.running():
            if received and forwarded is None and failed is None:
                forwarded = received[0]
                name = signal.Signals(forwarded).name
                self.say(f"{name}: forwarded to every rank (send it again to kill them)")
                self.signal_all(forwarded)
            if len(received) > 1:
                kill_at = min(kill_at, time.monotonic())
            if failed is None and forwarded is None:
                failed = self._first_failure()
                if failed is None and hang_timeout_s is not None:
                    failed = self._hung(hang_timeout_s)
                if failed is not None:
                    kill_at = self._stop(failed, grace_s)
            if time.monotonic() >= kill_at:
                self.signal_all(signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(_POLL_S)
        # Every rank has ended; what one left running in its process group would
        # outlive the launch and hold the rank's output open.
        self.signal_all(signal.SIGKILL)
        for pump in self.pumps:
            pump.join(timeout=5)
        if failed is None and forwarded is None:
            failed = self._first_failure(final=True)  # all may have ended between two polls
            if failed is not None:
                self._report(failed, None)
        if failed is not None:
            return Outcome(failed.status, failed, None)
        return Outcome(0 if forwarded is None else 128 + forwarded, None, forwarded)

    def _stop(self, failed: Failure, grace_s: float) -> float:
        """Stops the others after ``failed``; returns when they get SIGKILL."""
        if failed.cause.startswith("stopped answering"):
            # A silent rank holds every peer in a collective: none can act on SIGTERM.
            self._report(failed, 0.0)
            self.signal_all(signal.SIGKILL)
            return float("inf")
        wait = min(grace_s, KILLED_PEER_GRACE_S) if failed.status > 128 else grace_s
        self._report(failed, wait)
        self.signal_all(signal.SIGTERM)
        return time.monotonic() + wait

    def _report(self, failed: Failure, wait: float | None) -> None:
        text = f"rank {failed.rank} (pid {self.procs[failed.rank].pid}) {failed.cause}"
        with self.lock:
            running = sum(r != failed.rank for r in range(len(self.procs))) - sum(
                e.rank != failed.rank for e in self.exits
            )
        if running:
            text += f"; stopping the other {running} rank(s)"
            if wait == 0.0:
                text += " (SIGKILL)"
            elif wait is not None:
                text += f" (SIGTERM, then SIGKILL after {wait:g} s)"
        self.say(text)

    def _first_failure(self, *, final: bool = False) -> Failure | None:
        """The rank that failed first, once a rank exited with an error; else None.

        A rank still running but stopped or silent is the cause (JAX's heartbeat
        check aborts the peers of a stopped rank); otherwise :func:`first_to_fail`
        decides from the exits and the ranks' failure records, after waiting up to
        :data:`RECORD_WAIT_S` for every rank to end or record (not with ``final``:
        every rank has ended).
        """
        with self.lock:
            exits = list(self.exits)
        errors = [e for e in exits if e.status != 0]
        if not errors:
            return None
        stopped = self._hung(STALE_S) or self._hung(None)
        if stopped is not None:
            return stopped
        records = self._records()
        accounted = {e.rank for e in exits} | set(records)
        waited = time.monotonic() - errors[0].seen
        killed = any(_sent_from_outside(e) for e in errors)
        if not final and not killed and waited < RECORD_WAIT_S and len(accounted) < len(self.procs):
            return None
        first = first_to_fail(exits, records)
        assert first is not None  # an error exit is among them
        rank, status = first
        return _failure(rank, status, f"exited with status {describe(status)}")

    def _records(self) -> dict[int, FailureRecord]:
        found = {}
        for rank in range(len(self.procs)):
            if (record := read_failure(self.failure_file(rank))) is not None:
                found[rank] = record
        return found

    def _hung(self, timeout_s: float | None) -> Failure | None:
        """A running rank silent for ``timeout_s`` (None: one stopped by a signal now)."""
        with self.lock:
            ended = {e.rank for e in self.exits}
        now = time.time()
        for rank, proc in enumerate(self.procs):
            beat = self.heartbeat(rank)
            if rank in ended:
                continue
            state = _state(proc.pid)
            if state in (None, "Z", "X"):  # ended, its waiter not yet run (a loaded machine)
                continue
            if timeout_s is None:  # also with the watch off: a stopped rank is named
                if state in ("T", "t"):
                    cause = f"stopped answering ({_STATES[state]})"
                    return _failure(rank, 128 + signal.SIGKILL, cause)
                continue
            if beat is None:
                continue
            try:
                age = now - beat.stat().st_mtime
            except OSError:
                continue  # not yet up (jax.distributed started): not watched yet
            if age > timeout_s:
                how = _STATES.get(state, "running, its heartbeat thread silent")
                cause = f"stopped answering: no heartbeat for {age:.1f} s ({how})"
                return _failure(rank, 128 + signal.SIGKILL, cause)
        return None

    def signal_all(self, signum: int) -> None:
        for proc in self.procs:
            # The group may be gone already.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signum)

    def kill_all(self) -> None:
        """Leaves nothing running: SIGKILL to every rank's process group (what a rank
        started there ends with it, even after the rank itself exited), then reaps the
        ranks. Until then an ended rank is a zombie, so its pid, which names its
        group, cannot have been reused."""
        self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()


def first_to_fail(
    exits: Sequence[Exit], records: Mapping[int, FailureRecord]
) -> tuple[int, int] | None:
    """The rank that failed first and its status; None without an error exit.

    ``exits`` are in the order the launcher saw them; ``records`` are the ranks'
    own records of when their failure began (a non-zero ``sys.exit``, an uncaught
    exception: :mod:`jaxdp.cli._launch_link`). A rank killed from outside (SIGKILL,
    SIGTERM, SIGINT, SIGHUP) cannot have died of a peer's failure: the first of
    them. Otherwise each failure counts from the moment its rank recorded, else
    from when the launcher saw it end (a crash, a signal, a program that records
    nothing: that moment comes after the failure began, so such a rank is named
    only if it was seen to end before any peer recorded); the earliest, ties to
    the lower rank. A rank that recorded a failure and has not ended yet counts
    with the status it recorded. A rank that exits with ``128 + n`` after a signal
    (``jaxdp train`` stops on SIGINT or SIGTERM, and so do its peers, with 143) is
    ordered by its record: it records when the signal comes, the peers when they exit.
    """
    errors = [e for e in exits if e.status != 0]
    if not errors:
        return None
    killed = [e for e in errors if _sent_from_outside(e)]
    if killed:
        return killed[0].rank, killed[0].status
    moments = {e.rank: (e.seen, e.status) for e in errors}
    ended = {e.rank for e in exits}
    for rank, record in records.items():
        if rank in moments:
            moments[rank] = (min(record.began, moments[rank][0]), moments[rank][1])
        elif rank not in ended:
            moments[rank] = (record.began, record.status)
    rank = min(moments, key=lambda r: (moments[r][0], r))
    return rank, moments[rank][1]


def _failure(rank: int, status: int, cause: str) -> Failure:
    return Failure(rank, status, cause, time.monotonic(), time.time())


def _wait_unreaped(proc: subprocess.Popen[bytes]) -> tuple[int, bool]:
    """Waits for ``proc`` to end and returns its status and whether a signal ended it,
    leaving it unreaped where the system allows (``waitid`` with WNOWAIT):
    :meth:`Group.kill_all` reaps it."""
    if not hasattr(os, "waitid"):
        returncode = proc.wait()
        return _status(returncode), returncode < 0
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    assert info is not None  # None only with WNOHANG
    if info.si_code == os.CLD_EXITED:
        return info.si_status, False
    return 128 + info.si_status, True


def _status(returncode: int) -> int:
    """The shell's status: ``128 + n`` for a process ended by signal ``n``."""
    return 128 - returncode if returncode < 0 else returncode


def _sent_from_outside(end: Exit) -> bool:
    return end.killed and end.status - 128 in _SENT_FROM_OUTSIDE


def _state(pid: int) -> str | None:
    """The process's state letter from Linux's /proc (R, S, D, T, ...); None elsewhere."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def describe(status: int) -> str:
    """``137 (SIGKILL)`` for a signal's status, else the number."""
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

"""The parent side: worker processes per ``devices`` spec, started on first use and reused.

A group is one process (``devices(n)``) or ``p`` processes joined by JAX's distributed
runtime (``devices(n, processes=p)``). Each test is sent to every process of its group;
what comes back is each process's pytest reports, or how it ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from ._spec import Spec
from ._worker import STACKS_SIGNAL, main_environment

# After one process of a group failed, how long the others get to finish the test: a
# peer blocked in a collective the failed one never joins would wait for ever.
PEER_GRACE_S = float(os.environ.get("JAXDP_TESTING_PEER_GRACE_S", "10"))
_TAIL_CHARS = 4000
# How long a timed-out worker gets to write its threads' stacks before it is stopped
# (faulthandler writes them from the signal handler itself: milliseconds).
_STACKS_WAIT_S = 5.0


class Outcome:
    """What one process sent for one test: its reports, and how it ended if it did."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []
        self.done = False
        self.missing: str | None = None
        self.ended: str | None = None  # "died with signal 11 (SIGSEGV)", "was stopped ..."
        self.output = ""
        self.stacks = ""  # where its threads were when a timeout stopped it
        self.pid = 0

    def failed(self) -> bool:
        return (
            self.ended is not None
            or self.missing is not None
            or any(r.get("outcome") == "failed" for r in self.reports)
        )


class Process:
    """One worker: a pytest session in a subprocess, two pipes, and its output in a file."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        log: pathlib.Path | None,
        stacks: pathlib.Path,
    ):
        commands_r, self._commands_w = os.pipe()
        self._reports_r, reports_w = os.pipe()
        self.log, self.stacks = log, stacks
        out = open(log, "ab") if log else None  # noqa: SIM115 (the child keeps it)
        settings = json.loads(env.pop("JAXDP_TESTING_WORKER"))
        settings.update(
            commands=commands_r, reports=reports_w, stacks=str(stacks), parent=os.getpid()
        )
        env["JAXDP_TESTING_WORKER"] = json.dumps(settings)
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            pass_fds=(commands_r, reports_w),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,  # its group is killed with it: no test's child outlives it
        )
        for fd in (commands_r, reports_w):
            os.close(fd)
        if out:
            out.close()
        self._open = {self._commands_w, self._reports_r}
        self._buffer = b""
        self.ready: dict[str, Any] | None = None

    def send(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(BrokenPipeError):
            os.write(self._commands_w, (json.dumps(message) + "\n").encode())

    @property
    def fd(self) -> int:
        return self._reports_r

    def read_lines(self) -> list[dict[str, Any]] | None:
        """The complete messages now readable; None at end of file (the process ended)."""
        chunk = os.read(self._reports_r, 1 << 20)
        if not chunk:
            return None
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        return [json.loads(line) for line in lines]

    def log_offset(self) -> int:
        return self.log.stat().st_size if self.log and self.log.exists() else 0

    def output_since(self, offset: int) -> str:
        if not self.log:
            return "(its output went to the terminal: -s)"
        text = self.log.read_bytes()[offset:].decode(errors="replace")
        return text[-_TAIL_CHARS:] if text.strip() else "(none)"

    def how_it_ended(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "closed its report pipe"
        if code < 0:
            return f"died with signal {-code} ({signal.Signals(-code).name})"
        return f"exited with status {code}"

    def where(self) -> str:
        """Every thread's stack, as faulthandler writes it on :data:`STACKS_SIGNAL`."""
        offset = self.stacks.stat().st_size if self.stacks.exists() else 0
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, STACKS_SIGNAL)
        deadline = time.monotonic() + _STACKS_WAIT_S
        size = -1
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.stacks.stat().st_size if self.stacks.exists() else 0
            if now > offset and now == size:  # written, and no longer growing
                break
            size = now
        text = self.stacks.read_bytes()[offset:].decode(errors="replace").strip()
        return text or "(no stacks: the process did not answer)"

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._close(self._commands_w)
        self._close(self._reports_r)

    def _close(self, fd: int) -> None:
        # Once only: the number may belong to another file after the first close.
        if fd in self._open:
            self._open.remove(fd)
            os.close(fd)

    def finish(self) -> None:
        """Ends the session: its fixtures are torn down, then it exits (see :meth:`wait`)."""
        self._close(self._commands_w)

    def wait(self, deadline: float) -> None:
        """Waits for the end until ``deadline`` (monotonic), then kills what is left."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()


class Group:
    """The processes of one spec; started again after a process of it ended abnormally."""

    def __init__(self, spec: Spec, argv: list[str], cwd: str, logs: pathlib.Path):
        self.spec, self.argv, self.cwd, self.logs = spec, argv, cwd, logs
        self.processes: list[Process] = []
        self.starts = 0
        self._port: socket.socket | None = None

    def start(self) -> None:
        self.starts += 1
        settings = {"devices": self.spec.devices, "processes": self.spec.processes}
        runtime: dict[str, str] = {}
        if self.spec.processes > 1:
            self._port = _reserved_port()
            runtime = {
                "JAXDP_COORDINATOR_ADDRESS": f"127.0.0.1:{self._port.getsockname()[1]}",
                "JAXDP_NUM_PROCESSES": str(self.spec.processes),
                "JAXDP_CPU_DEVICES": str(self.spec.devices),
            }
        for rank in range(self.spec.processes):
            env = {**main_environment(settings), **runtime}
            if runtime:
                env["JAXDP_PROCESS_ID"] = str(rank)
            name = f"devices{self.spec.devices}x{self.spec.processes}-{self.starts}-p{rank}"
            log = self.logs / f"{name}.log" if self.argv[-1] != "--capture=no" else None
            stacks = self.logs / f"{name}.stacks"
            self.processes.append(Process(self.argv, env, self.cwd, log, stacks))

    def run(
        self, nodeid: str, nextid: str | None, shared: str, timeout: tuple[float, str] | None
    ) -> list[Outcome]:
        """Runs one test in every process; each process's outcome, in process order.

        ``timeout`` (seconds, and where they were set) bounds the test: past it, the
        processes still running are named with their threads' stacks, and stopped.
        Ctrl-C (``KeyboardInterrupt``) stops the processes at once, then goes on.
        """
        if not self.processes:
            self.start()
        outcomes = [Outcome() for _ in self.processes]
        for p, o in zip(self.processes, outcomes, strict=True):
            o.pid = p.proc.pid
        offsets = [p.log_offset() for p in self.processes]
        for p in self.processes:
            p.send({"run": nodeid, "next": nextid, "shared": shared})
        try:
            self._collect(outcomes, timeout)
        except BaseException:  # Ctrl-C: no process of this test outlives it
            self.stop(kill=True)
            raise
        for p, o, offset in zip(self.processes, outcomes, offsets, strict=True):
            if o.ended or o.missing:
                o.output = p.output_since(offset)
        if any(o.ended for o in outcomes):
            self.stop(kill=True)  # the next test starts the group afresh
        return outcomes

    def _collect(self, outcomes: list[Outcome], timeout: tuple[float, str] | None) -> None:
        selector = selectors.DefaultSelector()
        for i, p in enumerate(self.processes):
            selector.register(p.fd, selectors.EVENT_READ, i)
        deadline = float("inf")
        limit = float("inf")  # the timeout counts from the test's start, not the workers'
        while not all(o.done or o.ended for o in outcomes):
            if timeout and limit == float("inf") and all(p.ready for p in self.processes):
                limit = time.monotonic() + timeout[0]
            wait = min(deadline, limit) - time.monotonic()
            events = selector.select(timeout=max(0.0, min(wait, 60)))
            if not events and time.monotonic() >= limit and limit < deadline:
                assert timeout is not None
                seconds, where = timeout
                for p, o in zip(self.processes, outcomes, strict=True):
                    if not (o.done or o.ended):
                        o.ended = (
                            f"did not finish within the timeout of {seconds:g} s ({where}), "
                            "and was stopped"
                        )
                        o.stacks = p.where()
                break
            if not events and time.monotonic() >= deadline:
                for o in outcomes:
                    if not (o.done or o.ended):
                        o.ended = (
                            f"did not finish within {PEER_GRACE_S:g} s after another process "
                            "failed (waiting in a collective for it?), and was stopped"
                        )
                break
            for key, _ in events:
                p, o = self.processes[key.data], outcomes[key.data]
                messages = p.read_lines()
                if messages is None:
                    selector.unregister(p.fd)
                    o.ended = o.ended or p.how_it_ended()
                    continue
                for m in messages:
                    _take(o, m, p)
            if len(outcomes) > 1 and any(o.failed() for o in outcomes):
                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
        selector.close()

    def stop(self, kill: bool = False) -> None:
        # All told first: a process of a distributed run waits at exit for its peers.
        for p in self.processes:
            p.finish()
        deadline = time.monotonic() + (0 if kill else 30)
        for p in self.processes:
            p.wait(deadline)
        self.processes = []
        if self._port is not None:
            self._port.close()
            self._port = None


def _take(outcome: Outcome, message: dict[str, Any], process: Process) -> None:
    if "ready" in message:
        process.ready = message["ready"]
    elif "report" in message:
        outcome.reports.append(message["report"])
    elif "missing" in message:
        outcome.missing = message["missing"]
    elif "done" in message:
        outcome.done = True


def _reserved_port() -> socket.socket:
    """A socket holding a free local port for the coordinator (as jaxdp launch does):
    bound with SO_REUSEPORT and never listening, so only JAX's gRPC server binds beside it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if hasattr(socket, "SO_REUSEPORT"):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    return s


def worker_argv(config: pytest.Config, files: list[str]) -> list[str]:
    """``python -m pytest`` with the options that shape a test's run and its report.

    Selection, output files and distribution stay with the parent: ``addopts`` and
    ``PYTEST_ADDOPTS`` are not read again (so no ``-n``, ``--junitxml``, ``--lf``), the
    cache is off, and so is pytest-timeout (the parent bounds the whole group). No
    ``--basetemp``: a session empties its own, so each worker takes a numbered one of
    pytest's. The last argument is always the capture mode.
    """
    o = config.option
    args = ["-o", "addopts=", f"--rootdir={config.rootpath}", "-p", "no:cacheprovider"]
    # The parent bounds a test on all its processes (jaxdp_pytest._parent.timeout_of):
    # pytest-timeout in a worker would stop one process and leave its peers waiting.
    args += ["-p", "no:timeout"]
    if config.inipath:
        args += ["-c", str(config.inipath)]
    for plugin in o.plugins or []:
        if plugin not in ("xdist", "xdist.plugin", "no:cacheprovider", "timeout", "pytest_timeout"):
            args += ["-p", plugin]
    for flag, on in (
        ("--strict-markers", o.strict_markers),
        ("--runxfail", o.runxfail),
        ("--showlocals", o.showlocals),
        ("--full-trace", o.fulltrace),
        ("--noconftest", o.noconftest),
    ):
        if on:
            args.append(flag)
    args += [f"--tb={o.tbstyle}", f"--assert={o.assertmode}", f"--import-mode={o.importmode}"]
    args += ["-v"] * max(o.verbose, 0) + ["-q"] * max(-o.verbose, 0)
    for warning in o.pythonwarnings or []:
        args += ["-W", warning]
    for value in o.override_ini or []:
        if not value.startswith(("addopts=", "cache_dir=")):
            args += ["-o", value]
    if o.confcutdir:
        args.append(f"--confcutdir={o.confcutdir}")
    return [sys.executable, "-m", "pytest", *args, *files, f"--capture={o.capture}"]

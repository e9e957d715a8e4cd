"""Ctrl-C ends a jaxdp command: one line, exit status 130, within seconds, with its workers.

Python turns SIGINT into a KeyboardInterrupt raised wherever the main thread is, and not
every place lets it through: JAX's garbage-collection callback drops it ("Exception
ignored in: _xla_gc_callback"; a ``jaxdp parity`` interrupted while it imported JAX trained
on to PASS), orbax re-raises it as an ordinary ``Exception``, and the DDP ranks ``jaxdp
parity`` starts printed a traceback each and, when SIGINT reached the command alone,
trained on while its exit waited for them. So the command's process (never the library's
user's: :func:`jaxdp.cli.main` called with ``argv`` installs nothing) takes SIGINT over:

- the first Ctrl-C raises KeyboardInterrupt, as Python's own handler does, so that
  ``finally`` blocks and context managers unwind (a checkpoint directory's lock, temporary
  directories), and kills the command's worker processes (``multiprocessing``'s children:
  torch's ranks);
- it is raised outside imports, once they are done (a C extension's initialization
  cannot take it), and a KeyboardInterrupt dropped on its way (Python reports it to
  ``sys.unraisablehook``) is raised again in the main thread, outside what dropped it;
- a command still running :data:`GRACE_S` seconds after the first Ctrl-C (dropped where no
  hook hears it, or an unwinding that hangs) is ended there;
- a second Ctrl-C ends the process at once.

Whatever the interrupt became on its way up, the command then ends with one ``jaxdp
COMMAND: interrupted`` line and status 130, at once (:meth:`Interrupt.end`). The workers
a command spawns (``multiprocessing``'s spawn start method, which runs the command line's
``__main__`` again as ``__mp_main__``) end at once and silently on SIGINT: a terminal's
Ctrl-C reaches every process of its group, and the command speaks for them
(:func:`quiet_workers`).

Only SIGINT at Python's default (``default_int_handler``) is taken over: a command started
with SIGINT ignored (a background job of a non-interactive shell) keeps ignoring it.
"""

from __future__ import annotations

import _thread
import contextlib
import multiprocessing
import multiprocessing.spawn
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

# From the first Ctrl-C to the end when the interrupt does not make it up the stack:
# enough for a command to unwind (kill its workers, remove temporary directories, release
# locks: well under a second) on a loaded machine; short enough to be Ctrl-C.
GRACE_S = 3.0
# Process 0 of a multi-process run ends this much after its peers' deadline (Interrupt.end).
_LAST_S = 1.0
# A KeyboardInterrupt put off (an import) or dropped is raised again this much later: the
# main thread has left the garbage-collection callback that dropped it by then.
_AGAIN_S = 0.05
STATUS = 128 + signal.SIGINT
# The pid of a jaxdp command, in the environment its workers inherit (quiet_workers).
ENV_COMMAND_PID = "JAXDP_COMMAND_PID"


class Interrupt:
    """A command's Ctrl-C: whether it came, and how the command ends after it."""

    def __init__(self, command: str | None, *, own_process: bool):
        self.name = f"jaxdp {command}" if command else "jaxdp"
        self.own_process = own_process
        self.requested = False
        self.detail = ""  # what the interrupt stopped, when it says (a checkpoint's read)
        self._again = False  # a dropped KeyboardInterrupt is being raised again
        self._first: float | None = None  # time.monotonic() of the first Ctrl-C
        self._said = threading.Lock()

    def handler(self, signum: int, frame: Any) -> None:
        if self._again:
            self._again = False
        elif self.requested:  # a second Ctrl-C: now
            self.end_now()
        else:
            self.requested, self._first = True, time.monotonic()
            _kill_workers()
            threading.Thread(target=self._deadline, name="jaxdp-interrupt", daemon=True).start()
        if _importing(frame):
            # Not inside an import: a C extension's initialization cannot take it (jaxlib's
            # MLIR module aborted the process, 2 of 6 tries at 0.4 s); once it is done.
            self._later()
            return
        raise KeyboardInterrupt

    def dropped(self, previous: Any) -> Any:
        """A ``sys.unraisablehook`` that raises a dropped KeyboardInterrupt of this
        command's again, shortly, outside whatever dropped it (a garbage-collection
        callback, this hook); ``previous`` gets everything else."""

        def hook(unraisable: Any) -> None:
            if self.requested and isinstance(unraisable.exc_value, KeyboardInterrupt):
                self._later()
                return
            previous(unraisable)

        return hook

    def _later(self) -> None:
        """Raises the KeyboardInterrupt in the main thread :data:`_AGAIN_S` from now, as a
        signal would (through :meth:`handler`)."""

        def again() -> None:
            self._again = True
            _thread.interrupt_main(signal.SIGINT)

        timer = threading.Timer(_AGAIN_S, again)
        timer.daemon = True
        timer.start()

    def _deadline(self) -> None:
        time.sleep(GRACE_S + (_LAST_S if _coordinator() else 0.0))
        self.end_now()

    def say(self) -> None:
        """The command's one line, once, whoever ends it."""
        if self._said.acquire(blocking=False):
            detail = f": {self.detail}" if self.detail else ""
            print(f"{self.name}: interrupted (SIGINT){detail}", file=sys.stderr)

    def end_now(self) -> NoReturn:
        self.say()
        _kill_workers()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(STATUS)

    def end(self, error: BaseException | None) -> NoReturn:
        """Ends the command after the interrupt came up the stack as ``error`` (or as
        something else, or not at all): its line, its workers killed, status 130.

        The command's own process ends at once, past the interpreter's exit: what ran has
        unwound, and what is left is not the user's (JAX's shutdown barrier, which waits
        for the peers of a multi-process run; C++ threads that crashed the exit)."""
        if isinstance(error, KeyboardInterrupt) and error.args:
            self.detail = str(error)
        self.requested = True
        from ._launch_link import record_failure  # standard library only

        record_failure(STATUS)  # for jaxdp launch: this rank's end began here
        if self.own_process:
            if _coordinator() and self._first is not None:
                # Process 0 of a multi-process run holds JAX's coordinator: a peer still
                # ending when it goes aborts with a page of JAX's errors. Peers the same
                # Ctrl-C reached (jaxdp launch forwards it to all) end by their deadline.
                time.sleep(max(0.0, self._first + GRACE_S + _LAST_S / 2 - time.monotonic()))
            self.end_now()
        self.say()
        _kill_workers()
        raise SystemExit(STATUS)


@contextlib.contextmanager
def interruptible(command: str | None, own_process: bool) -> Iterator[Interrupt]:
    """Runs ``jaxdp COMMAND`` (None: no command given yet) with :class:`Interrupt` in charge
    of SIGINT, in the command's own process only (``own_process``, the main thread, SIGINT
    at Python's default); the caller ends with :meth:`Interrupt.end` when the command
    raised after an interrupt. Restores what it changed."""
    interrupt = Interrupt(command, own_process=own_process)
    if not (
        own_process
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        yield interrupt
        return
    previous_hook, previous_pid = sys.unraisablehook, os.environ.get(ENV_COMMAND_PID)
    signal.signal(signal.SIGINT, interrupt.handler)
    sys.unraisablehook = interrupt.dropped(previous_hook)
    os.environ[ENV_COMMAND_PID] = str(os.getpid())
    try:
        yield interrupt
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.unraisablehook = previous_hook
        if previous_pid is None:
            os.environ.pop(ENV_COMMAND_PID, None)
        else:
            os.environ[ENV_COMMAND_PID] = previous_pid


def quiet_workers() -> None:
    """In a worker a jaxdp command spawned (torch's DDP ranks of ``jaxdp parity``): SIGINT
    ends it at once and silently; the command (its parent) says the one line, and kills
    what is left. Elsewhere nothing: any other process importing the command line keeps
    its handlers."""
    if (
        multiprocessing.spawn.is_forking(sys.argv)  # a multiprocessing spawn child
        and os.environ.get(ENV_COMMAND_PID) == str(os.getppid())
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(STATUS))


def _coordinator() -> bool:
    """Whether this is process 0 of a multi-process run (it holds JAX's coordinator)."""
    jax = sys.modules.get("jax")
    try:
        return bool(
            jax is not None
            and jax.distributed.is_initialized()
            and jax.process_count() > 1
            and jax.process_index() == 0
        )
    except Exception:  # JAX still being imported (an interrupt it put off): not yet up
        return False


def _importing(frame: Any) -> bool:
    """Whether ``frame`` runs inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _kill_workers() -> None:
    for child in multiprocessing.active_children():
        with contextlib.suppress(OSError):
            child.kill()

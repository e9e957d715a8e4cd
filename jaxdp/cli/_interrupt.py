"""Ctrl-C ends a jaxdp command: one line, exit status 130, within seconds, with its workers.

Python turns SIGINT into a KeyboardInterrupt raised wherever the main thread is, when it
next runs Python, and not every place lets it through: JAX's garbage-collection callback
drops it ("Exception ignored in: _xla_gc_callback"; a ``jaxdp parity`` interrupted while it
imported JAX trained on to PASS), orbax re-raises it as an ordinary ``Exception``, a C
extension's initialization aborts on it, an XLA compile holds it for seconds, and the DDP
ranks ``jaxdp parity`` starts printed a traceback each and, when SIGINT reached the
command alone, trained on while its exit waited for them. So the command's process (never
the library's user's: :func:`jaxdp.cli.main` called with ``argv`` installs nothing) takes
SIGINT over:

- the first Ctrl-C raises KeyboardInterrupt, as Python's own handler does, so that
  ``finally`` blocks and context managers unwind (a checkpoint directory's lock, temporary
  directories), and kills the command's worker processes (``multiprocessing``'s children:
  torch's ranks); it is raised outside imports, once they are done, and a KeyboardInterrupt
  dropped on its way (Python reports it to ``sys.unraisablehook``) is raised again in the
  main thread, outside what dropped it;
- a thread hears the signal as it comes (``signal.set_wakeup_fd``), also while the main
  thread is in C code, and ends a command still running :data:`GRACE_S` seconds later
  (dropped where no hook hears it, an unwinding that hangs, a compile that goes on);
- a second Ctrl-C ends the process at once.

Whatever the interrupt became on its way up, the command then ends with one ``jaxdp
COMMAND: interrupted`` line and status 130, at once (:meth:`Interrupt.end`). ``jaxdp
train``'s loop lends SIGINT to its own handler, which stops at a checkpoint
(:meth:`Interrupt.lend`). The workers a command spawns (``multiprocessing``'s spawn start
method, which runs the command line's ``__main__`` again as ``__mp_main__``) end at once
and silently on SIGINT: a terminal's Ctrl-C reaches every process of its group, and the
command speaks for them (:func:`quiet_workers`).

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

# From a Ctrl-C to the end when the interrupt does not make it up the stack: enough for a
# command to unwind (kill its workers, remove temporary directories, release locks: well
# under a second) on a loaded machine; short enough to be Ctrl-C.
GRACE_S = 3.0
# Process 0 of a multi-process run ends this much after its peers' deadline (Interrupt.end).
_LAST_S = 1.5
# A KeyboardInterrupt put off (an import) or dropped is raised again this much later: the
# main thread has left the garbage-collection callback that dropped it by then.
_AGAIN_S = 0.05
STATUS = 128 + signal.SIGINT
# The pid of a jaxdp command, in the environment its workers inherit (quiet_workers).
ENV_COMMAND_PID = "JAXDP_COMMAND_PID"
_STOP = 0  # written to the wakeup pipe: the watcher ends


class Interrupt:
    """A command's Ctrl-C: whether it came, and how the command ends after it."""

    def __init__(self, command: str | None, *, own_process: bool):
        self.name = f"jaxdp {command}" if command else "jaxdp"
        self.own_process = own_process
        self.requested = False
        self.detail = ""  # what the interrupt stopped, when it says (a checkpoint's read)
        self._again = False  # a put-off or dropped KeyboardInterrupt is being raised again
        self._deadline: float | None = None  # time.monotonic() of the end, once armed
        self._lent = False  # SIGINT is jaxdp train's loop's (lend)
        self._heard_lent = 0  # signals the watcher heard while lent, not yet handled
        self._skip = 0  # signals the loop handled that the watcher has yet to hear
        self._lock = threading.Lock()
        self._said = threading.Lock()

    # ---- the main thread ----------------------------------------------------------------

    def handler(self, signum: int, frame: Any) -> None:
        if self._again:
            self._again = False
        elif self.requested:  # a second Ctrl-C: now
            self.end_now()
        else:
            self.requested = True
            self._arm()
            _kill_workers()
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

    @contextlib.contextmanager
    def lend(self) -> Iterator[Any]:
        """SIGINT is the caller's handler's while inside (``jaxdp train``'s loop, which
        stops at a checkpoint), until that handler calls the yielded function with the
        signal it took and gives SIGINT back: the watcher does not count that signal as
        this one's."""
        with self._lock:
            self._lent = True
        try:
            yield self._given_back
        finally:
            with self._lock:
                self._lent, self._heard_lent = False, 0

    def _given_back(self, signum: int) -> None:
        with self._lock:
            if signum == signal.SIGINT and self._heard_lent:
                self._heard_lent -= 1
            elif signum == signal.SIGINT:  # the watcher has not heard it yet
                self._skip += 1
            self._lent, self._heard_lent = False, 0

    # ---- the watcher ---------------------------------------------------------------------

    def watch(self, pipe: int) -> None:
        """Reads the signals the C handler writes to the wakeup ``pipe`` as they come; a
        SIGINT of this command's arms the deadline."""
        while (signals := os.read(pipe, 64)) and _STOP not in signals:
            for signum in signals:
                if signum != signal.SIGINT:
                    continue
                with self._lock:
                    if self._lent:
                        self._heard_lent += 1
                        continue
                    if self._skip:
                        self._skip -= 1
                        continue
                self._arm()

    def _arm(self) -> None:
        with self._lock:
            if self._deadline is not None:
                return
            self._deadline = time.monotonic() + GRACE_S
        threading.Thread(target=self._end_at_deadline, name="jaxdp-interrupt", daemon=True).start()

    def _end_at_deadline(self) -> None:
        assert self._deadline is not None
        last = _LAST_S if _coordinator() else 0.0
        time.sleep(max(0.0, self._deadline + last - time.monotonic()))
        self.end_now()

    # ---- the end --------------------------------------------------------------------------

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
            if _coordinator() and self._deadline is not None:
                # Process 0 of a multi-process run holds JAX's coordinator: a peer still
                # ending when it goes aborts with a page of JAX's errors. Peers the same
                # Ctrl-C reached (jaxdp launch forwards it to all) end by their deadline.
                time.sleep(max(0.0, self._deadline + _LAST_S - time.monotonic()))
            self.end_now()
        self.say()
        _kill_workers()
        raise SystemExit(STATUS)


_current: Interrupt | None = None


def lend_sigint() -> contextlib.AbstractContextManager[Any]:
    """:meth:`Interrupt.lend` of the command running in this process; where none took
    SIGINT over (the command called as a function), a function that does nothing."""
    if _current is None:
        return contextlib.nullcontext(lambda signum: None)
    return _current.lend()


@contextlib.contextmanager
def interruptible(command: str | None, own_process: bool) -> Iterator[Interrupt]:
    """Runs ``jaxdp COMMAND`` (None: no command given yet) with :class:`Interrupt` in charge
    of SIGINT, in the command's own process only (``own_process``, the main thread, SIGINT
    at Python's default); the caller ends with :meth:`Interrupt.end` when the command
    raised after an interrupt. Restores what it changed."""
    global _current
    interrupt = Interrupt(command, own_process=own_process)
    if not (
        own_process
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        yield interrupt
        return
    previous_hook, previous_pid = sys.unraisablehook, os.environ.get(ENV_COMMAND_PID)
    read, write = os.pipe()
    os.set_blocking(write, False)
    watcher = threading.Thread(target=interrupt.watch, args=(read,), daemon=True)
    watcher.name = "jaxdp-interrupt-watch"
    watcher.start()
    previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    signal.signal(signal.SIGINT, interrupt.handler)
    sys.unraisablehook = interrupt.dropped(previous_hook)
    os.environ[ENV_COMMAND_PID] = str(os.getpid())
    _current = interrupt
    try:
        yield interrupt
    finally:
        _current = None
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.set_wakeup_fd(previous_fd)
        sys.unraisablehook = previous_hook
        if previous_pid is None:
            os.environ.pop(ENV_COMMAND_PID, None)
        else:
            os.environ[ENV_COMMAND_PID] = previous_pid
        os.write(write, bytes([_STOP]))
        watcher.join()
        os.close(read)
        os.close(write)


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

"""Keeps gloo's connection note out of a process's standard output.

On CPU, several processes reduce over gloo, whose C++ code prints
``[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected
peer ranks is : 3`` to the C-level stdout when it connects, once per device
thread, at the first collective. A user cannot act on it, and threads writing
it at once cut it into pieces that land between the process's own lines
(a line that is only ``1``). Nothing in jaxlib turns it off, so
:func:`quiet_gloo_notes` separates the streams: Python's ``sys.stdout`` keeps
the original stream, and the C-level file descriptor 1 goes through a pipe
whose reader drops the note's pieces (and blank lines) and forwards everything else, whole
lines, to the original stream.

It changes the process, so the library never calls it (``jaxdp.initialize`` leaves fd 1
alone): ``jaxdp launch``'s rank wrapper (:mod:`jaxdp.cli._rank`, which loads this file
by its path: standard library only) and the pytest plugin's multi-process workers do,
in processes of their own.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import io
import os
import re
import sys
import threading

# Written through the pipe at exit, after C's buffer: the reader has forwarded everything
# before it once it reads it, also while a child process still holds the pipe open.
_DRAINED = b"\0jaxdp: drained\0"
_PIECES = re.compile(
    r"\[Gloo\] Rank |is connected to|peer ranks\.|Expected number of connected peer ranks is :"
)


def is_gloo_note(line: str) -> bool:
    """Whether ``line`` holds only pieces of gloo's note (and their numbers), or nothing:
    two threads ending their notes at once leave an empty line behind."""
    return not re.sub(r"[\d\s]", "", _PIECES.sub("", line))


def quiet_gloo_notes() -> bool:
    """Routes the C-level stdout through a filter that drops gloo's connection note.

    Only where the process writes its stdout to file descriptor 1 (not under
    an in-process capture). Returns whether the filter is in place. At exit,
    C's buffered output is flushed and drained through the filter first.
    """
    try:
        if sys.stdout.fileno() != 1:
            return False
    except (AttributeError, OSError, ValueError):
        return False
    sys.stdout.flush()
    original = os.dup(1)
    read, write = os.pipe()
    os.dup2(write, 1)
    os.close(write)
    old = sys.stdout
    # The same buffering as before, but whole lines: under python -u /
    # PYTHONUNBUFFERED (as jaxdp launch runs ranks) every line is written as it
    # ends, so nothing printed is lost when a rank is killed. Not unbuffered:
    # print writes its text and its newline apart, and the filter's own write
    # could land between the two (a CI run saw "python 2from C").
    unbuffered = not isinstance(getattr(old, "buffer", None), io.BufferedWriter)
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(original, "w", closefd=False)),
        encoding=old.encoding,
        errors=old.errors,
        line_buffering=unbuffered or old.line_buffering,
    )
    drained = threading.Event()
    pump = threading.Thread(target=_forward, args=(read, original, drained), daemon=True)
    pump.start()
    atexit.register(_drain, original, drained)
    return True


def _forward(read: int, out: int, drained: threading.Event) -> None:
    pending = b""
    while chunk := os.read(read, 65536):
        pending += chunk
        if _DRAINED in pending:  # the process exits: what it wrote before the mark goes out
            before, _, pending = pending.partition(_DRAINED)
            *lines, last = before.split(b"\n")
            _write(out, lines, last)
            drained.set()
        *lines, pending = pending.split(b"\n")
        _write(out, lines)
    _write(out, [], pending)
    os.close(read)
    drained.set()


def _write(out: int, lines: list[bytes], last: bytes = b"") -> None:
    """Writes ``lines`` (each with its newline) and ``last`` (without one), less gloo's note."""
    text = b"".join(x + b"\n" for x in lines if not is_gloo_note(x.decode(errors="replace")))
    if last and not is_gloo_note(last.decode(errors="replace")):
        text += last
    if text:
        os.write(out, text)


def _drain(original: int, drained: threading.Event) -> None:
    """Flushes C's stdout buffer into the pipe, marks its end and waits for the reader to
    forward everything before the mark (not for the pipe's end: a child process the
    program started may hold it open)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)
    sys.stdout.flush()
    with contextlib.suppress(OSError):
        os.write(1, _DRAINED)
    os.dup2(original, 1)  # this process's last write end of the pipe
    drained.wait(timeout=5)

"""A save in progress is never removed: leftovers of unfinished saves go only when none runs.

orbax writes a checkpoint into ``<step>.orbax-checkpoint-tmp`` and renames it when
complete, so a crash mid-save leaves that temporary directory behind. orbax's own
clean-up (``cleanup_tmp_directories``) removes every one when a directory is opened,
also the one a trainer is writing while an evaluation process opens the directory to
read ``steps``: the trainer's save then fails (``FileNotFoundError ...
commit_success.txt``), and two openings removing the same leftover at once fail one
of their first saves. Whether a temporary directory is a leftover cannot be told
from its name or age, only from whether a save is writing it, so every save holds a
shared ``flock`` on ``<directory>/jaxdp.saving`` from before its temporary directory
exists until after its rename, and a save removes leftovers only when it gets the
exclusive lock, that is when no save is running. Readers remove nothing. The kernel
drops a dead writer's lock however it died, as for ``jaxdp.lock`` (:mod:`._lock`), and
the file is there only while a save runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
from collections.abc import Iterator

import orbax.checkpoint as ocp

SAVING_NAME = "jaxdp.saving"
_TMP = ocp.path.atomicity_types.TMP_DIR_SUFFIX  # ".orbax-checkpoint-tmp"


@contextlib.contextmanager
def saving(directory: pathlib.Path) -> Iterator[None]:
    """Holds ``directory``'s save lock (shared) while the block writes a checkpoint.

    First, if no save is running there (the exclusive lock is free), removes the
    temporary directories of unfinished saves. The last save to end removes the lock
    file; whoever holds one that was removed meanwhile takes the new one.
    """
    path = directory / SAVING_NAME
    try:
        fd = _locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pass  # a save is running: whatever is temporary may be its
    else:
        for leftover in sorted(directory.iterdir()):
            if _TMP in leftover.name and leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
        os.close(fd)  # another save may clean up now: this one's directory is not made yet
    fd = _locked(path, fcntl.LOCK_SH)
    try:
        yield
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # another save is running: the last one removes the file
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # before the unlock: no one takes a dead file
        os.close(fd)


def _locked(path: pathlib.Path, operation: int) -> int:
    """A descriptor of ``path`` (created if missing) holding ``flock(operation)``, on the
    file the name holds now (not one a finished save removed meanwhile)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, operation)
        except BaseException:
            os.close(fd)
            raise
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            return fd
        os.close(fd)

"""One run at a time in a checkpoint directory: a lock file naming its owner.

Two runs resuming from one directory at once interleave their checkpoints, and
write the same step numbers: orbax's save of a step removes the temporary
directory of that step that the other run is writing. The lock is an
``flock`` on ``<directory>/jaxdp.lock``, which holds the owner's host, pid,
start time and command: the kernel releases it when the owner dies however it
dies, so a lock file left by a dead run is stale by construction and the next
run takes it over (saying whose it was), while a live owner is refused by name.
``flock`` works on local file systems and on NFS (as a POSIX lock through its
lock manager); where a file system ignores it, the lock cannot protect.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import pathlib
import socket
import sys
from collections.abc import Iterator
from typing import Any

from ._rules import CheckpointError

LOCK_NAME = "jaxdp.lock"


@contextlib.contextmanager
def directory_lock(directory: str | os.PathLike[str]) -> Iterator[dict[str, Any] | None]:
    """Holds the lock of ``directory`` (created if missing) while the block runs.

    Yields the owner recorded in a stale lock file that was taken over (a run
    that ended without releasing it), else None. Raises :class:`CheckpointError`
    if a live process holds it (naming it), or if the lock file cannot be
    written there (the directory is a file, read-only, ...).
    """
    directory = pathlib.Path(directory)
    with held(
        directory / LOCK_NAME,
        what=f"checkpoint directory {directory}",
        other="another directory (two runs in one directory would remove each other's "
        "unfinished checkpoints)",
    ) as stale:
        yield stale


@contextlib.contextmanager
def held(path: pathlib.Path, *, what: str, other: str) -> Iterator[dict[str, Any] | None]:
    """Holds lock file ``path`` (its folder created if missing) while the block runs, as
    :func:`directory_lock` does; errors name ``what`` is locked and suggest ``other``."""
    fd, stale = _acquire(path, what, other)
    try:
        yield stale
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # before the unlock: no one takes a dead file
        os.close(fd)


def describe_owner(owner: dict[str, Any]) -> str:
    """``host h, pid 12 (jaxdp train ..., since 2026-11-23 15:42:01)``."""
    text = f"host {owner.get('host', '?')}, pid {owner.get('pid', '?')}"
    details = [x for x in (owner.get("command"), owner.get("since")) if x]
    if len(details) == 2:
        details[1] = f"since {details[1]}"
    return text + (f" ({', '.join(details)})" if details else "")


def _acquire(path: pathlib.Path, what: str, other: str) -> tuple[int, dict[str, Any] | None]:
    directory = path.parent
    while True:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise CheckpointError(
                f"{what} cannot hold its lock file {path.name}: "
                f"{e.strerror} ({e.filename}); it must be a writable directory"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read(fd)
            os.close(fd)
            raise CheckpointError(
                f"{what} is in use by another run: {describe_owner(owner)} holds {path}. "
                f"Wait for it to end, or choose {other}"
            ) from None
        # Ours, unless the file was removed (its owner released it) between the
        # open and the flock: then the lock is on a file no one else will open.
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    stale = _read(fd) or None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_me()).encode(), 0)
    return fd, stale


def _me() -> dict[str, Any]:
    since = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
    program = pathlib.Path(sys.argv[0] if sys.argv else "")
    if program.name == "__main__.py":  # python -m jaxdp
        program = program.parent
    command = " ".join([program.name, *sys.argv[1:]]).strip()
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": since, "command": command}


def _read(fd: int) -> dict[str, Any]:
    try:
        owner = json.loads(os.pread(fd, 65536, 0) or b"{}")
    except ValueError:
        return {"host": "?", "pid": "?"}  # written half by a process that died meanwhile
    return owner if isinstance(owner, dict) else {}

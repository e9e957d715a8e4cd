"""``jaxdp train``'s persistent compilation cache: the programs a run compiles are kept on
disk, and the next run with the same shapes and flags reads them back instead of
compiling them again (JAX's persistent compilation cache). A program that cannot be
written (a full disk) is one warning, the entry it cut short is removed, and the run's
last line counts what was kept.

Where: ``--compile-cache DIR``, else the directory JAX already has (the
``JAX_COMPILATION_CACHE_DIR`` environment variable, or ``jax.config`` set by the caller of
:func:`jaxdp.cli.main`), whose settings are the user's; else a per-user directory,
``$XDG_CACHE_HOME/jaxdp/xla`` (``~/.cache/jaxdp/xla``; ``~/Library/Caches/jaxdp/xla`` on
macOS). ``--no-compile-cache`` turns it off. A cached program is the executable that
compiling would give, so a run's numbers are the same with or without it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import os
import pathlib
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

# Only programs that took 0.1 s or more to compile: a smaller one compiles again about as
# fast as it is read back (the test suite's floor, conftest.py, where it is measured).
# JAX's default, 1 s, keeps none of an MLP's programs on CPU.
MIN_COMPILE_TIME_S = 0.1
# A bound on the directory (least recently used entries go first). It also turns on JAX's
# file lock around every read and write: without it an entry is written in place, and
# another process (a rank of jaxdp launch, another run) could read one half written.
MAX_SIZE_BYTES = 2 * 2**30
_HIT, _WRITE = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"
# How JAX's warning for an entry it could not write begins (jax._src.compiler).
_WRITE_FAILED = "Error writing persistent compilation cache entry"


def add_compile_options(parser: argparse.ArgumentParser) -> None:
    """``--compile-cache DIR`` or ``--no-compile-cache``, one destination: ``compile_cache``
    (None: the default directory; False: off)."""
    option = parser.add_argument_group("compilation").add_mutually_exclusive_group().add_argument
    option(
        "--compile-cache",
        metavar="DIR",
        help="keep compiled programs in DIR, for the next run with the same shapes and flags "
        "(default: $JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/jaxdp/xla, "
        "~/.cache/jaxdp/xla)",
    )
    option(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_const",
        const=False,
        help="compile every program, read and write no compilation cache",
    )


def default_dir() -> pathlib.Path:
    """The per-user cache directory: ``$XDG_CACHE_HOME/jaxdp/xla``, else the platform's
    (``~/Library/Caches`` on macOS, ``%LOCALAPPDATA%`` on Windows, ``~/.cache`` elsewhere)."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base and sys.platform == "darwin":
        base = str(pathlib.Path.home() / "Library" / "Caches")
    elif not base and sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA")
    return pathlib.Path(base or pathlib.Path.home() / ".cache") / "jaxdp" / "xla"


@contextlib.contextmanager
def compile_cache(choice: str | bool | None) -> Iterator[Callable[[], str | None]]:
    """Sets JAX's persistent compilation cache for the block (call it before the first
    compile); yields ``report()``, the line that says where it is and how many programs the
    block read from it and wrote to it, and how many it could not write and why (None when
    off). JAX's settings are restored after.

    ``choice``: a directory (created here: one that cannot be is a ValueError naming it),
    False (off), or None: the directory JAX has, else :func:`default_dir` (one that cannot
    be created turns the cache off with a warning: a read-only home does not stop a run).
    With jaxdp's directory, programs compiled in at least :data:`MIN_COMPILE_TIME_S` are
    written, into at most :data:`MAX_SIZE_BYTES` (under a file lock) where ``filelock`` is
    installed; a ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` or
    ``JAX_COMPILATION_CACHE_MAX_SIZE`` in the environment is kept.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    theirs = jax.config.jax_compilation_cache_dir
    settings: dict[str, Any] = {}
    where = directory = None
    if choice is False:
        settings["jax_enable_compilation_cache"] = False
        off = "off (--no-compile-cache)"
    elif choice is None and theirs:
        off = "off (jax_enable_compilation_cache is False)"
        if jax.config.jax_enable_compilation_cache:
            named = os.environ.get("JAX_COMPILATION_CACHE_DIR") == theirs
            where = f"{theirs} ({'JAX_COMPILATION_CACHE_DIR' if named else 'jax.config'})"
            directory = theirs
    else:
        path = _created(choice)
        off = "off (no directory it can write)"
        if path is not None:
            settings.update(_jaxdp_settings(path))
            where = directory = str(path)
    before = {name: getattr(jax.config, name) for name in settings}
    counts = {_HIT: 0, _WRITE: 0}  # a write is counted when it begins
    failed = _FailedWrites(where, directory)

    def count(event: str, **kwargs: Any) -> None:
        if event in counts:
            counts[event] += 1

    def report() -> str:
        if where is None:
            return f"compilation cache: {off}"
        line = f"compilation cache {where}: {counts[_HIT]} program(s) read, "
        line += f"{counts[_WRITE] - len(failed.causes)} written"
        if failed.causes:
            line += f", {len(failed.causes)} not written ({', '.join(sorted(set(failed.causes)))})"
        return line

    _apply(settings, jax_cache)
    jax.monitoring.register_event_listener(count)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("always", message=_WRITE_FAILED)  # each one counts
            warnings.showwarning = failed.hook(warnings.showwarning)
            yield report
    finally:
        jax.monitoring.unregister_event_listener(count)
        _apply(before, jax_cache)


class _FailedWrites:
    """Takes JAX's warning for each cache entry it could not write (a full disk, ...):
    says the first once, naming the directory and the cause, counts the rest, and
    removes what a failed write left, where JAX stamps its entries (with a size bound).

    There, JAX writes an entry (``KEY-cache``) and then its last-use stamp
    (``KEY-atime``), under its file lock; a write cut short leaves an entry without a
    stamp (half written on a full disk), and every later write then failed on the
    missing stamp (FileNotFoundError, blaming no disk) while the half entry stayed
    to be read back as an error. Removing it leaves only whole entries, each stamped.
    A write that fails on a missing stamp all the same (another thread's, between a
    write cut short and its removal) is counted with the first write's cause.
    """

    def __init__(self, where: str | None, directory: str | None):
        self.where = where
        self.directory = None if directory is None else pathlib.Path(directory)
        self.causes: list[str] = []

    def hook(self, show: Callable[..., None]) -> Callable[..., None]:
        def showwarning(message: Warning | str, *args: Any, **kwargs: Any) -> None:
            text = str(message)
            if not text.startswith(_WRITE_FAILED):
                show(message, *args, **kwargs)
                return
            cause, removed = _cause(text), self._remove_unstamped()
            if cause == _MISSING:  # a stamp missing: another write was cut short first
                cause = self.causes[0] if self.causes else "an entry cut short before"
            self.causes.append(cause)
            if len(self.causes) == 1:
                program = text[len(_WRITE_FAILED) :].split("'")[1:2] or ["?"]
                left = f"; removed the {removed} entry it cut short" if removed else ""
                show(
                    f"compilation cache {self.where}: {self.causes[0]} writing the program "
                    f"{program[0]!r} ({text.split(': ', 1)[-1]}){left}; the programs not "
                    "written compile again in the next run (the run's last line counts them)",
                    *args,
                    **kwargs,
                )

        return showwarning

    def _remove_unstamped(self) -> int:
        """Removes, under JAX's lock, the entries without a stamp; returns how many.
        Only where JAX stamps entries: with a size bound (which needs ``filelock``)."""
        import jax

        if self.directory is None or jax.config.jax_compilation_cache_max_size <= 0:
            return 0
        import filelock

        removed = 0
        lock = filelock.FileLock(self.directory / ".lockfile", timeout=10)  # JAX's own
        with contextlib.suppress(OSError), lock:  # filelock.Timeout is an OSError
            for entry in self.directory.glob("*-cache"):
                stamp = entry.with_name(entry.name.removesuffix("-cache") + "-atime")
                if not stamp.exists():
                    entry.unlink(missing_ok=True)
                    removed += 1
        return removed


_MISSING = os.strerror(errno.ENOENT).lower()


def _cause(text: str) -> str:
    """``no space left on device`` for JAX's message of an OSError's errno, else its type."""
    found = re.search(r"\[Errno (\d+)\]", text)
    if found:
        return os.strerror(int(found.group(1))).lower()
    return text[len(_WRITE_FAILED) :].split(": ", 2)[1] if ": " in text else "an error"


def _created(choice: str | None) -> pathlib.Path | None:
    """The directory of ``--compile-cache`` (or the default), created."""
    path = pathlib.Path(choice).expanduser().absolute() if choice else default_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"[Errno 13] Permission denied: {str(path)!r}")
    except OSError as e:
        if choice:
            raise ValueError(
                f"compile_cache={choice!r} cannot be created or written: {e}"
            ) from None
        warnings.warn(
            f"no compilation cache: {path} cannot be created or written ({e}); every program "
            "compiles (--compile-cache DIR chooses another directory)",
            stacklevel=3,
        )
        return None
    return path


def _jaxdp_settings(path: pathlib.Path) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "jax_enable_compilation_cache": True,
        "jax_compilation_cache_dir": str(path),
    }
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        settings["jax_persistent_cache_min_compile_time_secs"] = MIN_COMPILE_TIME_S
    locked = importlib.util.find_spec("filelock") is not None  # JAX needs it for a bound
    if locked and "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        settings["jax_compilation_cache_max_size"] = MAX_SIZE_BYTES
    return settings


def _apply(settings: dict[str, Any], jax_cache: Any) -> None:
    """Sets ``settings``; where they change the cache, JAX opens it again at the next
    compile (it opens its cache once per process, at the first compile)."""
    import jax

    changed = False
    for name, value in settings.items():
        changed |= getattr(jax.config, name) != value
        jax.config.update(name, value)
    if changed:
        jax_cache.reset_cache()

"""``jaxdp train``'s persistent compilation cache: the programs a run compiles are kept on
disk, and the next run with the same shapes and flags reads them back instead of
compiling them again (JAX's persistent compilation cache).

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
import importlib.util
import os
import pathlib
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
    block read from it and wrote to it (None when off). JAX's settings are restored after.

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
    where = None
    if choice is False:
        settings["jax_enable_compilation_cache"] = False
        off = "off (--no-compile-cache)"
    elif choice is None and theirs:
        off = "off (jax_enable_compilation_cache is False)"
        if jax.config.jax_enable_compilation_cache:
            named = os.environ.get("JAX_COMPILATION_CACHE_DIR") == theirs
            where = f"{theirs} ({'JAX_COMPILATION_CACHE_DIR' if named else 'jax.config'})"
    else:
        path = _created(choice)
        off = "off (no directory it can write)"
        if path is not None:
            settings.update(_jaxdp_settings(path))
            where = str(path)
    before = {name: getattr(jax.config, name) for name in settings}
    counts = {_HIT: 0, _WRITE: 0}

    def count(event: str, **kwargs: Any) -> None:
        if event in counts:
            counts[event] += 1

    def report() -> str:
        if where is None:
            return f"compilation cache: {off}"
        return (
            f"compilation cache {where}: {counts[_HIT]} program(s) read, {counts[_WRITE]} written"
        )

    _apply(settings, jax_cache)
    jax.monitoring.register_event_listener(count)
    try:
        yield report
    finally:
        jax.monitoring.unregister_event_listener(count)
        _apply(before, jax_cache)


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

"""What ``jaxdp train`` will write, claimed before its first step: a finished run is never
lost to an output path, and a new run never overwrites another run's outputs.

Each output file's folder is created if missing and must take a file; the
checkpoint directory is created and locked (:mod:`jaxdp.checkpoint._lock`) for
the run. Process 0 writes the files and holds the lock; with several processes
every one learns whether process 0 could (one collective at the start), so
they stop together, before the first step.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
from collections.abc import Callable, Iterator, Mapping

import jax

from .._distributed import ENV_LAUNCH_STARTED, ENV_RESTART_COUNT
from ..checkpoint._lock import LOCK_NAME, describe_owner, directory_lock, held
from ..checkpoint._rules import check_is_directory
from ._metrics import agree


def check_file(name: str, path: str) -> None:
    """Creates the folders of output file ``path`` (option ``name``) and checks that it
    can be written there, without writing it. Raises ValueError naming the option."""
    file = pathlib.Path(path)
    for folder in file.absolute().parents:
        if folder.exists():
            if not folder.is_dir():
                raise ValueError(f"{name}={path!r} is inside {folder}, which is a file")
            break
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"{name}={path!r}: its folder {file.parent} cannot be created ({e.strerror}: "
            f"{e.filename})"
        ) from e
    if file.is_dir():
        raise ValueError(f"{name}={path!r} is a directory; it must name a file")
    try:
        if file.exists():
            with open(file, "ab"):  # appends nothing: the file stays as it is
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=file.parent, prefix=f".{file.name}."):
                pass
    except OSError as e:
        raise ValueError(
            f"{name}={path!r} cannot be written ({e.strerror}: {e.filename}); the run "
            "would be lost to it at the end"
        ) from e


def check_directory(name: str, path: str) -> None:
    """Creates output folder ``path`` (option ``name``) if missing and checks that it takes
    a file. Raises ValueError naming the option."""
    folder = pathlib.Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{name}={path!r} is a file; it must name a directory")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{name}={path!r} cannot be created: {e}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".jaxdp-check."):
            pass
    except OSError as e:
        raise ValueError(
            f"{name}={path!r} cannot be written ({e.strerror}: {e.filename}); the run's "
            "output would be lost to it"
        ) from e


def _hold_metrics(stack: contextlib.ExitStack, path: str) -> None:
    """Locks ``--metrics-out`` for the run."""
    file = pathlib.Path(path)
    stack.enter_context(
        held(
            file.parent / f".{file.name}.jaxdp.lock",
            what=f"metrics_out={path!r}",
            other="another file (two runs would truncate and interleave each other's records)",
        )
    )


def _hold_board(stack: contextlib.ExitStack, path: str) -> None:
    """Locks ``--tensorboard`` for the run, once it is known to take files."""
    check_directory("tensorboard", path)
    stack.enter_context(
        held(
            pathlib.Path(path) / LOCK_NAME,
            what=f"tensorboard={path!r}",
            other="another directory (TensorBoard shows one run per folder: two runs in one "
            "mix their points, and a resume's purge hides the other's)",
        )
    )


def check_fresh(
    files: Mapping[str, str | None], tensorboard: str | None, *, own_since: float | None = None
) -> None:
    """For a run that starts fresh (not resumed): refuses output files (``files``: option
    name -> path: ``metrics_out`` holding records, ``summary_out`` or ``plot`` holding
    anything) or a ``--tensorboard`` folder holding event files, another run's, which it
    would overwrite or mix with its own. Files last modified at or after ``own_since``
    (``time.time()``; a restarted launch's start) are this run's own earlier starts'.
    On process 0; the others raise too."""

    def another_runs(path: pathlib.Path, *, empty: bool = True) -> bool:
        try:
            stat = path.stat()
        except FileNotFoundError:
            return False
        return (empty or stat.st_size > 0) and (own_since is None or stat.st_mtime < own_since)

    failure: ValueError | None = None
    if jax.process_index() == 0:
        failure = _another_runs_file(files, lambda p: another_runs(p, empty=False))
        events = []
        if tensorboard is not None:
            found = pathlib.Path(tensorboard).glob("events.out.*")
            events = sorted(p.name for p in found if another_runs(p))
        if failure is None and events:
            failure = ValueError(
                f"tensorboard={tensorboard!r} holds event files of another run ({events[0]}"
                f"{' ...' if len(events) > 1 else ''}); TensorBoard shows one run per "
                "folder: choose another directory (e.g. a subfolder per run), or resume "
                "that run (--resume)"
            )
    if agree(failure is not None):
        raise failure or ValueError("process 0 found another run's records in an output")


def own_outputs_since() -> float | None:
    """In a group ``jaxdp launch`` restarted, when the launch began: outputs written
    since are its earlier starts' (no other run could write them while a start held
    their lock), which a fresh start overwrites. None elsewhere: all are another run's.

    Not the restart count alone: a first start refused for another run's records
    exits 2, and its restart then overwrote them.
    """
    started = os.environ.get(ENV_LAUNCH_STARTED, "")
    if os.environ.get(ENV_RESTART_COUNT, "0") in ("", "0") or not started:
        return None
    try:
        return float(started)
    except ValueError:
        return None  # not the launcher's: refuse as a new run does


# What a finished run leaves in each output file, for the refusal that names it.
_HOLDS = {"summary_out": "the summary", "plot": "the plot"}


def _another_runs_file(
    files: Mapping[str, str | None], another_runs: Callable[[pathlib.Path], bool]
) -> ValueError | None:
    """The refusal of the first of ``files`` that holds another run's output, if any."""
    for name, path in files.items():
        if path is None or not another_runs(file := pathlib.Path(path)):
            continue
        if name == "metrics_out":
            lines = file.read_text(errors="replace").count("\n")
            return ValueError(
                f"metrics_out={path!r} holds {lines} record(s) of another run; a new "
                "run would overwrite them: choose another file, or resume that run (--resume)"
            )
        return ValueError(
            f"{name}={path!r} holds {_HOLDS.get(name, 'the output')} of another run "
            f"({file.stat().st_size} bytes); a new run would overwrite it: choose another "
            "file (or remove that one), or resume that run (--resume)"
        )
    return None


@contextlib.contextmanager
def claimed(
    files: Mapping[str, str | None],
    checkpoint_dir: str | None,
    *,
    tensorboard: str | None = None,
) -> Iterator[None]:
    """Checks ``files`` (option name -> path) and holds ``checkpoint_dir``'s lock for the block;
    also those of ``files["metrics_out"]`` and of the ``tensorboard`` folder (see
    :func:`check_fresh` for another run's records in them).

    On process 0; the others raise too when it cannot (ValueError, a
    ``CheckpointError`` for the directory).
    """
    with contextlib.ExitStack() as stack:
        failure: ValueError | None = None
        if jax.process_index() == 0:
            try:
                for name, path in files.items():
                    if path is not None:
                        check_file(name, path)
                if checkpoint_dir is not None:
                    check_is_directory(checkpoint_dir, name="checkpoint_dir")
                    stale = stack.enter_context(directory_lock(checkpoint_dir))
                    if stale:
                        print(
                            f"took over the lock of {checkpoint_dir}, left by a run that is no "
                            f"longer running ({describe_owner(stale)})"
                        )
                # After the checkpoint directory, whose refusal says more.
                if files.get("metrics_out") is not None:
                    _hold_metrics(stack, files["metrics_out"])
                if tensorboard is not None:
                    _hold_board(stack, tensorboard)
            except ValueError as e:  # CheckpointError included
                failure = e
        if agree(failure is not None):
            raise failure or ValueError(
                "process 0 cannot write the run's outputs or lock its checkpoint directory "
                "(its error says why)"
            )
        yield


def lock_while(checkpoint_dir: str) -> contextlib.AbstractContextManager[None]:
    """The lock of ``checkpoint_dir`` alone (a resume reading its config), as :func:`claimed`."""
    return claimed({}, checkpoint_dir)

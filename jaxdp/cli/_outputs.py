"""What ``jaxdp train`` will write, claimed before its first step: a finished run is never
lost to an output path.

Each output file's folder is created if missing and must take a file; the
checkpoint directory is created and locked (:mod:`jaxdp.checkpoint._lock`) for
the run. Process 0 writes the files and holds the lock; with several processes
every one learns whether process 0 could (one collective at the start), so
they stop together, before the first step.
"""

from __future__ import annotations

import contextlib
import pathlib
import tempfile
from collections.abc import Iterator, Mapping

import jax

from ..checkpoint._lock import describe_owner, directory_lock
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


@contextlib.contextmanager
def claimed(files: Mapping[str, str | None], checkpoint_dir: str | None) -> Iterator[None]:
    """Checks ``files`` (option name -> path) and holds ``checkpoint_dir``'s lock for the block.

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

"""What ``jaxdp launch`` runs in each process: the argv of a command (a Python script
or module through :mod:`jaxdp.cli._rank`, a jaxdp subcommand, a program), and the
check that it can run, made once before any process starts: one line and status 2
instead of a traceback from every rank.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
from collections.abc import Collection, Sequence
from typing import Any

# The rank wrapper every Python rank runs through (jaxdp launch, jaxdp run).
RANK_WRAPPER = str(pathlib.Path(__file__).with_name("_rank.py"))


def check_runnable(argv: list[str]) -> None:
    """One line before anything starts, instead of a traceback per rank (or none): a
    script that does not exist, a module ``python -m`` would not find, a program not
    on PATH."""
    if argv[0] == sys.executable and argv[1] == RANK_WRAPPER:
        if argv[2] == "-m":
            _check_module(argv[3] if len(argv) > 3 else "")
        elif not os.path.isfile(argv[2]):
            raise ValueError(f"script {argv[2]!r} does not exist (in {os.getcwd()})")
    elif shutil.which(argv[0]) is None:
        raise ValueError(
            f"command {argv[0]!r} is not a jaxdp subcommand, a Python script (.py), -m module "
            "or a program found on PATH"
        )


def _check_module(name: str) -> None:
    """Raises ValueError unless ``python -m name`` would find something to run in a rank
    started in this directory: a module, or a package with a ``__main__`` module.

    Nothing is imported (no package's ``__init__`` runs here): each dotted part is
    looked up by the import system's finders (``sys.meta_path``: editable installs
    included) in the locations of the package before it.
    """
    if not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"-m {name!r} must be a module's dotted name, e.g. -m pkg.train")
    spec = _module_spec(name)
    if spec is None:
        raise ValueError(
            f"-m {name!r}: no module named {name!r} (looked up from {os.getcwd()} and "
            "sys.path, as python -m does in every rank)"
        )
    if spec.submodule_search_locations is not None and _module_spec(f"{name}.__main__") is None:
        raise ValueError(
            f"-m {name!r} is a package without a __main__ module: python -m cannot run it "
            f"(give one of its modules, -m {name}.MODULE)"
        )


def _module_spec(name: str) -> Any:
    """The spec ``python -m`` started here would find for ``name``, without importing."""
    if (loaded := getattr(sys.modules.get(name), "__spec__", None)) is not None:
        return loaded  # also os.path, which no finder finds by that name
    # A rank's sys.path: python -m puts the working directory first.
    locations: list[str] | None = [os.getcwd(), *sys.path[1:]]
    parts = name.split(".")
    spec = None
    for i in range(len(parts)):
        if locations is None:  # a module, not a package: it has no submodules
            return None
        fullname = ".".join(parts[: i + 1])
        spec = next(
            (
                found
                for finder in sys.meta_path
                if hasattr(finder, "find_spec")
                and (found := finder.find_spec(fullname, locations, None)) is not None
            ),
            None,
        )
        if spec is None:
            return None
        locations = spec.submodule_search_locations
    return spec


def child_argv(command: Sequence[str], subcommands: Collection[str] = ()) -> list[str]:
    """The argv each process runs for ``command`` (see :func:`launch`); Python runs
    through :mod:`jaxdp.cli._rank`."""
    command = list(command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ValueError("give the command to run after --, e.g. -- train --steps 5")
    if command[0] == "jaxdp":
        command = command[1:]
        if not command:
            raise ValueError("give the jaxdp subcommand to run, e.g. -- jaxdp train --steps 5")
    head = command[0]
    if head == "launch":
        raise ValueError("jaxdp launch cannot launch itself")
    if head in subcommands:
        return [sys.executable, RANK_WRAPPER, "-m", "jaxdp", *command]
    if head == "-m" or head.endswith(".py"):
        return [sys.executable, RANK_WRAPPER, *command]
    return command

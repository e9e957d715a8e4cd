"""``jaxdp run [--] SCRIPT.py ARGS`` (or ``-m MODULE ARGS``): one process of a run that
another launcher started (``mpirun``, ``srun``, torchrun), run as ``jaxdp launch`` runs
each of its ranks (:mod:`jaxdp.cli._rank`): an uncaught exception or a non-zero
``sys.exit`` ends the process at once, after its traceback, instead of holding it in
JAX's shutdown barrier while its peers wait in a collective (``timeout_s``, 100 s by
``jaxdp.initialize``'s default), and the status is the script's own. The process is
replaced (``exec``) by the wrapper, so its pid, its environment (the launcher's
variables, which JAX's cluster detection reads) and its signals stay the launcher's, and
nothing of jaxdp or JAX is imported before the script: a library cannot do this for a
process it does not own (``jaxdp.initialize`` changes nothing in it), a command of
jaxdp's own can.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from ._command import RANK_WRAPPER, check_runnable


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``jaxdp run``'s options, added to its parser ``p`` (``jaxdp.cli._main.SUBCOMMANDS``)."""
    p.description = (
        "Runs a Python script (or -m module) as one process of a multi-process run that "
        "another launcher started (mpirun, srun), as jaxdp launch runs its ranks: a "
        "failure ends the process at once with its status, rather than in JAX's shutdown "
        "barrier. Example: mpirun -np 2 jaxdp run train.py --steps 50"
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the script and its arguments, or -m MODULE and its arguments (after --)",
    )
    p.set_defaults(run=_run)


def _error(message: str) -> NoReturn:
    print(f"jaxdp run: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command or not (command[0] == "-m" or command[0].endswith(".py")):
        _error(f"give a Python script (.py) or -m MODULE to run, got {command!r}")
    argv = [sys.executable, RANK_WRAPPER, *command]
    try:
        check_runnable(argv)
    except ValueError as e:
        _error(str(e))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 0  # not reached: exec replaced the process

"""The ``jaxdp`` command line: ``train``, ``launch``, ``parity``, ``plan``.

Its own dependencies (scikit-learn for the digits images, tqdm, matplotlib) come
with the ``cli`` extra: ``pip install 'jaxdp[cli]'``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ._interrupt import Interrupt as _Interrupt
from ._interrupt import quiet_workers as _quiet_workers

__all__ = ["main"]

_quiet_workers()  # in the DDP ranks jaxdp parity spawns: Ctrl-C is the command's to report


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``jaxdp`` on ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    As the ``jaxdp`` command (no ``argv``), Ctrl-C ends the process with one line and status
    130, within seconds (:mod:`jaxdp.cli._interrupt`), also while the command line still
    imports its modules. Called with ``argv`` in a program of its own, the program's signal
    handling stays, and a KeyboardInterrupt ends the command with the same line and
    ``SystemExit(130)``.
    """
    try:  # the command line's modules, imported here: a Ctrl-C comes before their handling
        from ._main import main as run
    except KeyboardInterrupt as e:
        words = sys.argv[1:] if argv is None else list(argv)
        given = next((w for w in words if not w.startswith("-")), None)
        command = given if given is not None and given.isidentifier() else None
        _Interrupt(command, own_process=argv is None).end(e)
    return run(argv)

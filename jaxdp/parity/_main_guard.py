"""A script's DDP ranks run the script again: refuse a call outside its main guard.

torch's DDP ranks start with ``torch.multiprocessing.spawn``, which imports the
parent's ``__main__`` file again in every rank (as ``__mp_main__``). A call made at
the script's top level, outside ``if __name__ == "__main__":``, then runs again in
each rank, which tries to start ranks of its own while it is still starting, and
spawn only says "process 0 terminated with exit code 1". The call is refused before
anything trains, saying what to add.
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path


def check_main_guard(call: str) -> None:
    """Raises ``ValueError`` when the running script makes ``call`` from its top-level
    code outside an ``if __name__ == "__main__":`` block. An interactive session,
    ``python -c`` and a notebook have no file to import again: nothing is checked."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None:
        return
    frame = inspect.currentframe()
    while frame is not None and not (
        frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"
    ):
        frame = frame.f_back
    if frame is None:  # the script's top level is not running (a thread, atexit)
        return
    line = frame.f_lineno
    try:
        statements = ast.parse(Path(path).read_text()).body
    except (OSError, SyntaxError, ValueError):  # no source to read: spawn's own problem
        return
    for statement in statements:
        if statement.lineno <= line <= (statement.end_lineno or statement.lineno):
            if _guards(statement, line):
                return
            raise ValueError(
                f"{call} starts DDP ranks that import {Path(path).name} again (torch's "
                "spawn), which would run this call again in each rank: put it under "
                f'`if __name__ == "__main__":` (line {line})'
            )


def _guards(statement: ast.stmt, line: int) -> bool:
    """Whether ``line`` is in the body of ``if __name__ == "__main__":``."""
    if not (isinstance(statement, ast.If) and _is_main_test(statement.test)):
        return False
    first, last = statement.body[0], statement.body[-1]
    return first.lineno <= line <= (last.end_lineno or last.lineno)


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    texts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return isinstance(test.ops[0], ast.Eq) and names == ["__name__"] and texts == ["__main__"]

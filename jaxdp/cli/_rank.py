"""How ``jaxdp launch`` runs a Python rank: ``python _rank.py SCRIPT ARGS`` or
``python _rank.py -m MODULE ARGS``, as ``python SCRIPT ARGS`` or ``python -m MODULE ARGS``
would, but a non-zero ``sys.exit`` ends the process at once, and a failure's start
is recorded for the launcher.

``sys.exit(3)`` raises SystemExit, which no excepthook sees; after it the
interpreter runs JAX's exit handler, whose shutdown barrier waits for every
process. Its peers are blocked in a collective that waits for it, so it sat there
``timeout_s`` (100 s) and JAX then aborted it (134): the 3 was lost. Here, in a
multi-process JAX run, it exits with its own status at once, as
:func:`jaxdp.initialize`'s excepthook does for an uncaught exception.

Before the rank's code runs, its heartbeat starts: it beats once the rank joined
the run (the launcher finds a stopped rank by it). A non-zero ``sys.exit`` or an
uncaught exception is recorded first (:mod:`jaxdp.cli._launch_link`): its peers
fail when this process ends, and the launcher, which may reap them first, names the
rank whose failure began first.

Run as a file, not ``-m jaxdp...``: nothing of jaxdp (or JAX) is imported before
the rank's own code; the record's module is loaded by its path.
"""

import importlib.util
import os
import pathlib
import runpy
import sys
import types


def _load_launch_link() -> types.ModuleType:
    path = pathlib.Path(__file__).parent / "_launch_link.py"
    spec = importlib.util.spec_from_file_location("_jaxdp_launch_link", path)
    assert spec is not None and spec.loader is not None  # a .py file that ships with jaxdp
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    link = _load_launch_link()
    if beat := os.environ.get(link.ENV_HEARTBEAT_FILE):
        link.start_heartbeat(beat)  # beats once the rank joined the run
    record = link.record_failure
    args = sys.argv[1:]
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]  # runpy sets argv[0] to the module's file
            sys.path[0] = os.getcwd()  # as python -m does
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = args
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))  # as python SCRIPT does
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or e.code == 0:
            raise
        status = (e.code if isinstance(e.code, int) else 1) & 0xFF
        record(status)
        if not _in_a_multi_process_run():
            raise
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)  # as the interpreter prints it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    except BaseException as e:  # the interpreter reports it: 1, or SIGINT's 130
        record(130 if isinstance(e, KeyboardInterrupt) else 1)
        raise


def _in_a_multi_process_run() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1


if __name__ == "__main__":
    main()

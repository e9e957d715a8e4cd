"""How ``jaxdp launch`` runs a Python rank: ``python _rank.py SCRIPT ARGS`` or
``python _rank.py -m MODULE ARGS``, as ``python SCRIPT ARGS`` or ``python -m MODULE ARGS``
would, but a failure ends the process at once, its start is recorded for the launcher,
and gloo's connection note is kept out of its stdout. This wrapper is jaxdp's own
process, so it may do what the library may not (end the process on a failure, route
fd 1): ``jaxdp.initialize`` leaves the process as it found it.

A failing rank of a multi-process JAX run ends at once: with an uncaught exception
(status 1, 130 for KeyboardInterrupt, after its traceback) or a non-zero ``sys.exit``
(its own status). Otherwise the interpreter runs JAX's exit handler, whose shutdown
barrier waits for every process while its peers are blocked in a collective that
waits for it: it sat there ``timeout_s`` (100 s) and JAX then aborted it (134), the
status lost; no heartbeat failed meanwhile, so the launch hung that long.

Before the rank's code runs, its heartbeat starts: it beats once the rank joined
the run (the launcher finds a stopped rank by it). A non-zero ``sys.exit`` or an
uncaught exception is recorded first (:mod:`jaxdp.cli._launch_link`): its peers
fail when this process ends, and the launcher, which may reap them first, names the
rank whose failure began first.

In a launch of several processes, the C-level stdout goes through
:func:`jaxdp._quiet_gloo.quiet_gloo_notes` before the rank's code runs: on CPU, gloo's
C++ code writes a connection note there from several threads at once, cut into pieces
between the rank's own lines. (It is harmless where gloo never speaks, on GPUs.)

Run as a file, not ``-m jaxdp...``: nothing of jaxdp (or JAX) is imported before
the rank's own code; the modules it needs (stdlib only) are loaded by their paths.
"""

import importlib.util
import os
import pathlib
import runpy
import sys
import types


def _load(path: pathlib.Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"_jaxdp_rank{path.stem}", path)
    assert spec is not None and spec.loader is not None  # a .py file that ships with jaxdp
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    here = pathlib.Path(__file__).parent
    link = _load(here / "_launch_link.py")
    if beat := os.environ.get(link.ENV_HEARTBEAT_FILE):
        link.start_heartbeat(beat)  # beats once the rank joined the run
    processes = os.environ.get("JAXDP_NUM_PROCESSES", "")  # set by jaxdp launch
    if processes.isdigit() and int(processes) > 1:
        _load(here.parent / "_quiet_gloo.py").quiet_gloo_notes()
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
    except BaseException as e:  # reported as the interpreter would: 1, or SIGINT's 130
        status = 130 if isinstance(e, KeyboardInterrupt) else 1
        record(status)
        if not _in_a_multi_process_run():
            raise
        sys.excepthook(type(e), e, e.__traceback__)
        jax = sys.modules["jax"]
        print(
            f"jaxdp: process {jax.process_index()} ends on this {type(e).__name__} at once; "
            "its peers stop when they miss its heartbeat",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _in_a_multi_process_run() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1


if __name__ == "__main__":
    main()

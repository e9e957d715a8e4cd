"""How ``jaxdp launch`` runs a Python rank: ``python _rank.py SCRIPT ARGS`` or
``python _rank.py -m MODULE ARGS``, as ``python SCRIPT ARGS`` or ``python -m MODULE ARGS``
would, but a failure ends the process at once, its start is recorded for the launcher,
and gloo's connection note is kept out of its stdout. This wrapper is jaxdp's own
process, so it may do what the library may not (end the process on a failure, route
fd 1): ``jaxdp.initialize`` leaves the process as it found it.

A failing rank of a multi-process JAX run ends at once: with an uncaught exception
(status 1, after its traceback; a KeyboardInterrupt: 130 after one line naming where it
came) or a non-zero ``sys.exit`` (its own status). Otherwise the interpreter runs JAX's
exit handler, whose shutdown barrier waits for every process while its peers are
blocked in a collective that waits for it: it sat there ``timeout_s`` (100 s) and JAX
then aborted it (134), the status lost; no heartbeat failed meanwhile, so the launch
hung that long.

Before the rank's code runs, its heartbeat starts: it beats once the rank joined
the run (the launcher finds a stopped rank by it), until the rank's code is done (its
exit is never a hang). A non-zero ``sys.exit`` or an
uncaught exception is recorded first (:mod:`jaxdp.cli._launch_link`): its peers
fail when this process ends, and the launcher, which may reap them first, names the
rank whose failure began first.

In a launch of several processes, the C-level stdout goes through
:func:`jaxdp._quiet_gloo.quiet_gloo_notes` before the rank's code runs: on CPU, gloo's
C++ code writes a connection note there from several threads at once, cut into pieces
between the rank's own lines. (It is harmless where gloo never speaks, on GPUs.)

A rank of a launch of several processes that cannot join its run ends with one
``jaxdp launch: error:`` line and status 2, its failure recorded, where JAX used to
abort it (134, a native stack): before the rank's code runs, a rank other than 0 asks
the coordinator's port what listens there and refuses another program
(:func:`~jaxdp.cli._launch_link.check_coordinator`, as ``jaxdp train`` does); and a
daemon watchdog ends every rank that has not joined ``timeout_s`` (``JAXDP_TIMEOUT_S``,
or ``initialize``'s) after its ``jaxdp.initialize`` began to wait. The watchdog arms
only once that wait began (its thread, named ``jaxdp-join``, lives while it lasts): a
script may work for long before joining, or never join and need no peers. It gives
up at ``timeout_s`` itself, not a few seconds before: the wrapper sets
``JAXDP_JOIN_GRACE_S`` (private to the launch, read and removed by ``initialize``),
which puts JAX's own deadline that much later, so the setting keeps its meaning and a
run that joins just in time is not ended early.

Run as a file, not ``-m jaxdp...``: nothing of jaxdp (or JAX) is imported before
the rank's own code; the modules it needs (stdlib only) are loaded by their paths.
"""

import importlib.util
import os
import pathlib
import runpy
import sys
import threading
import time
import traceback
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
        if run := link.run_of(os.environ):
            _guard_the_join(link, *run)
    record = link.record_failure
    args = sys.argv[1:]
    try:
        try:
            if args[0] == "-m":
                sys.argv = [args[1], *args[2:]]  # runpy sets argv[0] to the module's file
                sys.path[0] = os.getcwd()  # as python -m does
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = args
                sys.path[0] = os.path.dirname(os.path.abspath(args[0]))  # as python SCRIPT does
                runpy.run_path(args[0], run_name="__main__")
        finally:
            if beat:  # the rank's code is done: what is left is its exit, never a hang
                link.stop_heartbeat(beat)
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
    except KeyboardInterrupt as e:  # one line, not a traceback per rank; status 130
        record(130)
        frames = traceback.extract_tb(e.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        print(
            f"jaxdp launch: process {os.environ.get('JAXDP_PROCESS_ID', '?')} interrupted "
            f"(KeyboardInterrupt){where}",
            file=sys.stderr,
        )
        if not _in_a_multi_process_run():
            raise SystemExit(130) from None
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    except BaseException as e:  # reported as the interpreter would: 1
        status = 1
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


def _guard_the_join(link: types.ModuleType, who: str, address: str) -> None:
    """Refuses a coordinator's port held by another program; starts the join's watchdog."""
    if not who.startswith("process 0 "):
        try:
            link.check_coordinator(address, who)
        except ValueError as e:
            link.give_up("jaxdp launch", str(e))
    os.environ["JAXDP_JOIN_GRACE_S"] = str(link.JAX_GRACE_S)
    threading.Thread(
        target=_watch_the_join, args=(link, who, address), name="jaxdp-join-watchdog", daemon=True
    ).start()


def _watch_the_join(link: types.ModuleType, who: str, address: str) -> None:
    """Ends the process (:func:`give_up`) once ``jaxdp.initialize`` waited its ``timeout_s``
    for the run to join; returns when the run is up without a wait seen, or the wait ended."""
    while True:
        # Whether the run is up, asked before looking for the wait: the wait begins before
        # JAX's client exists and ends after it connected, so "up, and no wait after" means
        # joined. Asked after, a wait that began in between was missed as joined (a CI run
        # on a loaded machine: the rank ran on to JAX's abort).
        up = link.joined()
        joining = next((t for t in threading.enumerate() if t.name == "jaxdp-join"), None)
        if joining is not None:
            break
        if up:  # up without a wait seen here: nothing to watch
            return
        time.sleep(0.1)
    # The wait began within 0.1 s; JAX's deadline is JAX_GRACE_S after timeout_s.
    # (joined() is true during the wait already: JAX's client exists before it connects.)
    began = time.monotonic()
    while joining.is_alive():
        if time.monotonic() - began >= joining.timeout_s:
            said = link.never_joined(who, address, joining.timeout_s, joining.timeout_source)
            link.give_up("jaxdp launch", f"{said}; the script stopped in jaxdp.initialize")
            return  # give_up ends the process; a stand-in for it may not
        joining.join(0.1)


def _in_a_multi_process_run() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1


if __name__ == "__main__":
    main()

"""jaxdp's pytest plugin under hangs (issue 33): Ctrl-C stops a hung devices test and its
processes, a killed pytest leaves no worker behind, and a timeout names each process
still running with its threads' stacks. Each runs pytest in a subprocess on a small
suite; processes are found by parent and session in /proc, never by name."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

SUITE = """
import os
import pathlib
import time

import pytest


def started():
    pathlib.Path(os.environ["STARTED"], str(os.getpid())).touch()


@pytest.mark.devices(1, processes=2)
def test_sleeps():
    started()
    time.sleep(3600)


@pytest.mark.timeout(3)
@pytest.mark.devices(1, processes=2)
def test_waits_for_a_sleeping_peer():
    import jax
    from jax.experimental import multihost_utils

    started()
    if jax.process_index() == 0:
        time.sleep(3600)
    multihost_utils.sync_global_devices("never joined by process 0")
"""
# pytest with Python's Ctrl-C, whatever this process inherited (a shell's & ignores SIGINT).
PYTEST = (
    "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.exit(pytest.console_main())"
)
# Generous bounds, never met by a working plugin: a hang fails the test, not the suite.
START_S = 120  # two JAX processes and their distributed runtime, on a loaded machine
END_S = 20  # pytest's end after the signal; before: never (or 30 s at best)


def stat(pid):
    """``(state, parent, session)`` of a process, or None once it is gone."""
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    state, parent, _, session = text.rsplit(")", 1)[1].split()[:4]
    return state, int(parent), int(session)


def running_in_sessions(sessions):
    """The live processes of these sessions (a worker leads one; its children join it)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = stat(int(name))
            if s is not None and s[2] in sessions and s[0] != "Z":
                found.append(int(name))
    return found


@pytest.fixture
def hung(tmp_path):
    """Starts pytest on one test of the suite; returns it and its workers once both
    processes of the test are in it."""
    (tmp_path / "test_hang.py").write_text(SUITE)
    (tmp_path / "started").mkdir()
    pytests = []

    def start(test, *args):
        env = dict(os.environ, STARTED=str(tmp_path / "started"))
        process = subprocess.Popen(
            # -rN: no short summary, which on CI (CI set) repeats each failure's whole message.
            [sys.executable, "-c", PYTEST, "-p", "no:cacheprovider", "-p", "no:randomly", "-rN"]
            + [f"test_hang.py::{test}", *args],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        pytests.append(process)
        deadline = time.monotonic() + START_S
        while len(os.listdir(tmp_path / "started")) < 2:
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "the test's two processes did not start"
            time.sleep(0.1)
        workers = [
            pid
            for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
            if (stat(pid) or ("", 0, 0))[1] == process.pid
        ]
        assert len(workers) == 2, workers
        pytests.append(workers)
        return process, workers

    yield start
    for process in pytests:  # whatever the test found, nothing is left running
        if isinstance(process, list):
            for pid in running_in_sessions(set(process)):
                os.kill(pid, signal.SIGKILL)
        else:
            process.kill()
            process.wait()


def test_ctrl_c_stops_a_hung_test_and_its_processes(hung):
    process, workers = hung("test_sleeps")
    process.send_signal(signal.SIGINT)
    out, _ = process.communicate(timeout=END_S)
    assert process.returncode == 2, out  # pytest's "interrupted"
    assert "KeyboardInterrupt" in out
    assert running_in_sessions(set(workers)) == []


def test_a_killed_pytest_leaves_no_worker_running(hung):
    process, workers = hung("test_sleeps")
    process.kill()
    process.wait()
    deadline = time.monotonic() + END_S
    while running_in_sessions(set(workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running_in_sessions(set(workers)) == []  # before: both ran on, under init


def test_a_timeout_names_each_process_and_where_its_threads_were(hung):
    # The mark (pytest-timeout's) wins over the plugin's option.
    process, workers = hung("test_waits_for_a_sleeping_peer", "--jaxdp-timeout=600")
    out, _ = process.communicate(timeout=START_S)
    assert process.returncode == 1, out
    stopped = re.findall(
        r"process ([01]) of 2 for devices\(1, processes=2\) \(pid (\d+)\) did not finish "
        r"within the timeout of 3 s \(@pytest.mark.timeout\(3\)\), and was stopped",
        out,
    )
    assert {int(pid) for _, pid in stopped} == set(workers), out
    assert sorted(rank for rank, _ in stopped) == ["0", "1"], out
    assert out.count("---- where its threads were when it was stopped ----") == 2
    sleep = [i for i, line in enumerate(SUITE.splitlines(), 1) if "sleep(3600)" in line][1]
    assert f"line {sleep} in test_waits_for_a_sleeping_peer" in out  # process 0's sleep
    assert "in sync_global_devices" in out  # process 1, waiting in the collective
    assert running_in_sessions(set(workers)) == []


def test_a_bad_timeout_option_is_a_usage_error_naming_it(tmp_path):
    (tmp_path / "test_hang.py").write_text(SUITE)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--jaxdp-timeout=-1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=START_S,
    )
    assert run.returncode == 4, run.stdout + run.stderr  # pytest's usage error
    assert "--jaxdp-timeout: -1 must be a number of seconds >= 0 (0: none)" in run.stderr

"""jaxdp's pytest plugin (jaxdp_pytest): a test suite of its own, run by pytest in a
subprocess, passes where it should and fails where it should, sequentially and under -n 2."""

import collections
import os
import pathlib
import re
import subprocess
import sys

import pytest

CONFTEST = """
import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)  # the suite's count: the marks win over it


@pytest.fixture(scope="module")
def worker_pid():
    import os
    return os.getpid()
"""

SUITE = """
import ctypes
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdp


def record(spec):
    # Which process ran each test: one JAX start per spec, checked by the outer test.
    with open(os.environ["STARTS"], "a") as f:
        f.write(f"{spec} {os.getpid()}\\n")


def test_unmarked_runs_here_with_the_suites_count():
    assert len(jax.devices()) == 8


@pytest.mark.devices(1)
def test_one():
    record(1)
    assert len(jax.devices()) == 1


@pytest.mark.devices(2)
@pytest.mark.parametrize("x", [1, 2])
def test_two(x, tmp_path, capsys, monkeypatch, worker_pid):
    record(2)
    monkeypatch.setenv("SET_BY_TEST", str(x))
    print("printed", x)
    assert capsys.readouterr().out == f"printed {x}\\n"
    (tmp_path / "f").write_text("x")
    assert len(jax.devices()) == 2 and worker_pid == os.getpid()


@pytest.mark.devices(2)
def test_monkeypatch_was_undone():
    record(2)
    assert "SET_BY_TEST" not in os.environ


@pytest.mark.devices(4)
def test_four_fails_with_introspection():
    record(4)
    counts = [len(jax.devices())]
    assert counts == [5]


@pytest.mark.devices(8)
def test_eight():
    record(8)
    mesh = jaxdp.data_mesh()
    assert mesh.devices.size == 8


@pytest.mark.devices(4)
@pytest.mark.skip(reason="skipped in the worker")
def test_skipped():
    pass


@pytest.mark.devices(4)
@pytest.mark.xfail(reason="fails as expected", strict=True)
def test_xfail():
    assert len(jax.devices()) == 3


@pytest.mark.devices(4)
def test_exit_ends_the_worker():
    os._exit(3)


@pytest.mark.devices(4)
def test_after_the_exit():
    record(4)
    assert len(jax.devices()) == 4


@pytest.mark.devices(1)
def test_segfault():
    ctypes.string_at(0)


@pytest.mark.devices(2, processes=2)
def test_two_processes(shared_tmp_path):
    record("2x2")
    mesh = jaxdp.data_mesh()
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), np.ones(2))
    assert float(total(x)) == 4.0 and jax.process_count() == 2
    (shared_tmp_path / str(jax.process_index())).write_text("seen")
    assert len(jax.local_devices()) == 2


@pytest.mark.devices(2, processes=2)
def test_process_one_fails_and_zero_waits_for_it():
    record("2x2")
    mesh = jaxdp.data_mesh()
    if jax.process_index() == 1:
        raise RuntimeError("process 1 gives up before the collective")
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), np.ones(2))
    assert float(total(x)) == 4.0


@pytest.mark.devices(0)
def test_no_devices():
    pass


@pytest.mark.devices(processes=2)
def test_processes_without_devices():
    pass


@pytest.mark.devices(1000)
def test_too_many_devices():
    pass
"""

EXPECTED = {
    "test_unmarked_runs_here_with_the_suites_count": "PASSED",
    "test_one": "PASSED",
    "test_two[1]": "PASSED",
    "test_two[2]": "PASSED",
    "test_monkeypatch_was_undone": "PASSED",
    "test_four_fails_with_introspection": "FAILED",
    "test_eight": "PASSED",
    "test_skipped": "SKIPPED",
    "test_xfail": "XFAIL",
    "test_exit_ends_the_worker": "FAILED",
    "test_after_the_exit": "PASSED",
    "test_segfault": "FAILED",
    "test_two_processes": "PASSED",
    "test_process_one_fails_and_zero_waits_for_it": "FAILED",
    "test_no_devices": "ERROR",
    "test_processes_without_devices": "ERROR",
    "test_too_many_devices": "ERROR",
}


def run_pytest(path, *args, starts=None):
    env = dict(os.environ, JAXDP_TESTING_PEER_GRACE_S="3", STARTS=str(starts or path / "starts"))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:randomly", *args],
        cwd=path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def outcomes(stdout):
    """``{test name: PASSED/FAILED/...}`` from the short summary (-rA)."""
    words = r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) \S+::(\S+)"
    found = {name: word for word, name in re.findall(words, stdout, re.M)}
    # Skips are folded into one line per file and reason.
    if re.search(r"^SKIPPED \[1\] test_suite.py:\d+: skipped in the worker$", stdout, re.M):
        found["test_skipped"] = "SKIPPED"
    return found


# One worker runs this file under pytest-xdist, so the module's runs of the example suite
# (`sequential`: about 30 s) are made once, not once per worker that gets one of its tests.
pytestmark = pytest.mark.xdist_group("testing_plugin")


# docs/testing.md's example test file (its first Python block) runs in the sequential run
# beside the suite, on the suite's workers: test_docs.py leaves that block to this file.
DOCS_EXAMPLE = re.findall(
    r"^```python\n(.*?)^```",
    (pathlib.Path(__file__).parent.parent / "docs" / "testing.md").read_text(),
    re.M | re.S,
)[0]
DOCS_EXPECTED = {f"test_n_devices_step_like_one[{n}]": "PASSED" for n in (1, 2, 4, 8)}
DOCS_EXPECTED["test_two_processes_share_one_mesh"] = "PASSED"


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    path = tmp_path_factory.mktemp("suite")
    (path / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers\n")
    (path / "conftest.py").write_text(CONFTEST)
    (path / "test_suite.py").write_text(SUITE)
    (path / "test_sharded.py").write_text(DOCS_EXAMPLE)
    return path


@pytest.fixture(scope="module")
def sequential(suite):
    return run_pytest(suite)


def test_each_test_gets_its_outcome(sequential):
    assert outcomes(sequential.stdout) == EXPECTED | DOCS_EXPECTED, sequential.stdout[-6000:]
    assert sequential.returncode == 1


def test_a_failing_assertion_shows_pytests_introspection(sequential):
    out = sequential.stdout
    assert "    def test_four_fails_with_introspection():" in out
    assert ">       assert counts == [5]" in out
    assert "E       assert [4] == [5]" in out
    assert "E         At index 0 diff: 4 != 5" in out


def test_a_crash_fails_that_test_only_naming_it(sequential):
    out = sequential.stdout
    exit_line = re.search(
        r"the worker for devices\(4\) \(pid \d+\) exited with status 3 while "
        r"running test_suite.py::test_exit_ends_the_worker",
        out,
    )
    segv = re.search(
        r"the worker for devices\(1\) \(pid \d+\) died with signal 11 \(SIGSEGV\) "
        r"while running test_suite.py::test_segfault",
        out,
    )
    assert exit_line and segv, out[-6000:]
    assert 'File "' in out and "in test_segfault" in out  # faulthandler's traceback, shown


def test_one_jax_start_per_spec(suite, sequential):
    starts = collections.defaultdict(set)
    for line in (suite / "starts").read_text().splitlines():
        spec, pid = line.split()
        starts[spec].add(pid)
    # devices(4) starts again after test_exit_ends_the_worker ended its worker; the
    # two-process group is two processes, started once.
    assert {spec: len(pids) for spec, pids in starts.items()} == {
        "1": 1,
        "2": 1,
        "4": 2,
        "8": 1,
        "2x2": 2,
    }


def test_a_failing_process_is_named_and_its_blocked_peer_stopped(sequential):
    out = sequential.stdout
    assert "RuntimeError: process 1 gives up before the collective" in out
    assert "jaxdp.testing: process 1 of 2 failed; the traceback above is process 1 of 2's" in out
    assert re.search(
        r"process 0 of 2 for devices\(2, processes=2\) \(pid \d+\) did not finish "
        r"within 3 s after another process failed",
        out,
    )


def test_bad_marks_name_the_argument_and_the_rule(sequential):
    out = sequential.stdout
    assert "@pytest.mark.devices(0): n=0 must be a positive integer" in out
    assert (
        "@pytest.mark.devices(processes=2) needs the device count of each process: "
        "devices(n) or devices(n, processes=p)"
    ) in out
    assert "@pytest.mark.devices(1000): n=1000 exceeds the 512" in out


def test_the_same_outcomes_under_xdist(suite, tmp_path):
    done = run_pytest(suite, "-n", "2", "test_suite.py", starts=tmp_path / "starts")
    assert outcomes(done.stdout) == EXPECTED, done.stdout[-6000:]
    assert "E       assert [4] == [5]" in done.stdout


def test_selection_and_stopping_work_as_usual(suite, sequential):
    # One run for --lf, -k and -x (issue 31: they were three, then two). Of the tests -k
    # chooses, --lf runs only those that failed in the sequential run: test_two[1],
    # test_two[2] and test_after_the_exit passed there and do not run, and -k leaves out
    # the failures it does not choose (test_exit_ends_the_worker, the two-process one, the
    # bad marks). -x stops at the first failure: test_segfault, chosen, failed in the
    # sequential run and after test_four_fails_with_introspection, does not run.
    chosen = run_pytest(
        suite,
        "--lf",
        "-x",
        "-k",
        "two and not processes or four or after or segfault",
        "test_suite.py",
    )
    assert outcomes(chosen.stdout) == {"test_four_fails_with_introspection": "FAILED"}, (
        chosen.stdout[-6000:]
    )
    assert "stopping after 1 failures" in chosen.stdout


def test_switched_off_the_mark_is_unknown(suite):
    done = run_pytest(suite, "-p", "no:jaxdp", "-k", "test_one", "test_suite.py")
    assert "'devices' not found in `markers` configuration option" in done.stdout + done.stderr

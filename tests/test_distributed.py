"""Several processes, the command line's side: jaxdp launch, `jaxdp train` on two
processes, and what happens when a rank fails (the library's side is
tests/core/test_initialize.py). Multi-process runs are subprocesses with their own
device counts (jaxdp launch --devices-per-process), never this process's 8."""

import contextlib
import dataclasses
import errno
import io
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types

import jax
import numpy as np
import pytest
from helpers import alive, left_behind

import jaxdp
from jaxdp.cli import main
from jaxdp.cli._group import RECORD_WAIT_S, Exit, Group, first_to_fail
from jaxdp.cli._launch import child_argv
from jaxdp.cli._launch_link import ENV_FAILURE_FILE, FailureRecord, read_failure, record_failure
from jaxdp.cli._train import TrainConfig, build, make_step, train
from jaxdp.testing import TOLERANCES, assert_trees_close

ROOT = pathlib.Path(__file__).parent.parent
LAUNCH = [sys.executable, "-m", "jaxdp", "launch"]
# The launcher's grace period in the failure tests.
GRACE_S = 2


def run_script(tmp_path, code, args, **kwargs):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run(
        [*LAUNCH, *args, "--", str(script)], capture_output=True, text=True, cwd=ROOT, **kwargs
    )


# ---- jaxdp.initialize ----------------------------------------------------------------


def test_launch_resolves_scripts_modules_and_subcommands():
    py, rank = sys.executable, str(ROOT / "jaxdp" / "cli" / "_rank.py")
    assert child_argv(["--", "train", "--steps", "5"], {"train"}) == [
        py,
        rank,
        "-m",
        "jaxdp",
        "train",
        "--steps",
        "5",
    ]
    assert child_argv(["jaxdp", "train"], {"train"}) == [py, rank, "-m", "jaxdp", "train"]
    assert child_argv(["run.py", "a"]) == [py, rank, "run.py", "a"]
    assert child_argv(["-m", "pkg.mod"]) == [py, rank, "-m", "pkg.mod"]
    assert child_argv(["echo", "hi"]) == ["echo", "hi"]
    with pytest.raises(ValueError, match="give the command to run after --"):
        child_argv(["--"])
    with pytest.raises(ValueError, match="cannot launch itself"):
        child_argv(["launch"], {"launch"})


HELD = f"[Errno {errno.EADDRINUSE}] {os.strerror(errno.EADDRINUSE)}"


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--nprocs", "0"], "nprocs=0 must be a positive integer"),
        (["--nprocs", "2", "--grace-s", "nan"], "grace_s=nan must be a finite number of sec"),
        (["--nprocs", "2", "--timeout-s", "0"], "timeout_s=0 must be a positive integer"),
        (["--nprocs", "2", "--max-restarts", "-1"], "max_restarts=-1 must be an integer >= 0"),
        (["--nprocs", "2", "--hang-timeout-s", "inf"], "--hang-timeout-s inf must be a finite"),
        (
            ["--nprocs", "2", "--hang-timeout-s", "-5"],
            "--hang-timeout-s -5.0 must be a finite number of seconds > 0, or 0 to turn the "
            "watch off",
        ),
        (["--nprocs", "2", "--", "no_such_program"], "command 'no_such_program' is not a"),
        (["--nprocs", "2", "--", "no_such.py"], "script 'no_such.py' does not exist (in "),
        # Issue 33.4: a traceback from every rank, exit 1, where a script got one line.
        (
            ["--nprocs", "2", "--", "-m", "no_such_module"],
            f"-m 'no_such_module': no module named 'no_such_module' (looked up from {ROOT} ",
        ),
        (["--nprocs", "2", "--", "-m", "jaxdp.no_such"], "-m 'jaxdp.no_such': no module named"),
        (["--nprocs", "2", "--", "-m", "jaxdp.cli"], "-m 'jaxdp.cli' is a package without a "),
    ],
)
def test_launch_usage_errors_exit_2_with_one_line(flags, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    command = [] if "--" in flags else ["--", str(ROOT / "examples" / "multi_process.py")]
    with pytest.raises(SystemExit) as exit_:
        main(["launch", *flags, *command])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxdp launch: error: {message}") and err.count("\n") == 1


def test_launch_runs_a_module_found_from_its_working_directory(tmp_path):
    """-m takes modules and packages with a __main__ from the ranks' directory, as python -m."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__main__.py").write_text("print('main')")
    (tmp_path / "pkg" / "job.py").write_text("print('job')")
    path = os.environ.get("PYTHONPATH")  # jaxdp from this checkout, run from tmp_path
    for module, said in (("pkg", "main"), ("pkg.job", "job")):
        done = subprocess.run(
            [*LAUNCH, "--nprocs", "1", "--", "-m", module],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), path]))},
            timeout=60,
        )
        assert (done.returncode, done.stdout) == (0, f"[rank 0] {said}\n"), done.stderr


def test_launch_gives_each_rank_its_environment_and_prefixes_its_output(tmp_path):
    done = run_script(
        tmp_path,
        """
        import os, socket, sys
        env = [os.environ[f"JAXDP_{n}"] for n in ("PROCESS_ID", "NUM_PROCESSES",
               "COORDINATOR_ADDRESS", "CPU_DEVICES", "LOCAL_DEVICE_IDS", "TIMEOUT_S")]
        print(*env)
        print("to stderr", file=sys.stderr)
        # The launcher holds the coordinator's port until the ranks end: nothing else
        # can take it between its choice and the coordinator's bind.
        try:
            socket.socket().bind(("127.0.0.1", int(env[2].split(":")[1])))
        except OSError as e:
            print(e, file=sys.stderr)
        """,
        ["--nprocs", "3", "--devices-per-process", "2", "--timeout-s", "7"],
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = sorted(done.stdout.splitlines())
    address = lines[0].split()[4]
    assert address.startswith("127.0.0.1:")
    assert lines == [f"[rank {r}] {r} 3 {address} 2 {2 * r},{2 * r + 1} 7" for r in range(3)]
    expected = [f"[rank {r}] {line}" for r in range(3) for line in ("to stderr", HELD)]
    assert sorted(done.stderr.splitlines()) == sorted(expected)


def test_launch_stops_the_others_when_one_fails_and_exits_with_its_status(tmp_path):
    # Rank 0 ignores SIGTERM: the launcher must follow up with SIGKILL after the grace.
    start = time.monotonic()
    done = run_script(
        tmp_path,
        """
        import os, signal, time
        if os.environ["JAXDP_PROCESS_ID"] == "1":
            raise SystemExit(7)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(os.getpid(), flush=True)
        time.sleep(600)
        """,
        ["--nprocs", "2", "--grace-s", str(GRACE_S)],
        timeout=60,
    )
    took = time.monotonic() - start
    assert done.returncode == 7
    assert "jaxdp launch: rank 1 (pid " in done.stderr
    assert "exited with status 7; stopping the other 1 rank(s)" in done.stderr
    assert "jaxdp launch: failed: rank 1 exited with status 7" in done.stderr
    assert took < GRACE_S + 20
    survivor = int(done.stdout.split()[-1])
    assert not pathlib.Path(f"/proc/{survivor}").exists()


def test_a_rank_killed_by_a_signal_gets_its_peers_killed_after_a_second(tmp_path):
    """Rank 0 cannot act on SIGTERM, as one blocked in a gloo collective with a dead
    peer: the launcher does not wait the whole --grace-s before SIGKILL (item 13)."""
    grace_s = 120
    start = time.monotonic()
    done = run_script(
        tmp_path,
        """
        import os, signal, time
        if os.environ["JAXDP_PROCESS_ID"] == "1":
            time.sleep(1)  # rank 0 is up and ignores SIGTERM
            os.kill(os.getpid(), signal.SIGKILL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
        """,
        ["--nprocs", "2", "--grace-s", str(grace_s)],
        timeout=grace_s + 60,
    )
    took = time.monotonic() - start
    assert done.returncode == 128 + signal.SIGKILL
    assert (
        "exited with status 137 (SIGKILL); stopping the other 1 rank(s) (SIGTERM, then "
        "SIGKILL after 1 s)"
    ) in done.stderr
    assert "jaxdp launch: failed: rank 1 exited with status 137 (SIGKILL)" in done.stderr
    # 1 s of grace plus starting two Python processes; before: the whole 120 s. The
    # bound is far from both, so a loaded machine cannot make it flaky.
    assert took < 60
    print(f"rank killed: the launcher ended {took:.1f} s after the start")


def test_no_rank_outlives_a_killed_launcher(tmp_path):
    """SIGKILL cannot be caught: the ranks must still end (Linux parent-death signal)."""
    script = tmp_path / "script.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    launcher = subprocess.Popen(
        [*LAUNCH, "--nprocs", "2", "--", str(script)], stdout=subprocess.PIPE, cwd=ROOT
    )
    ranks = {}
    try:
        for _ in range(2):
            assert launcher.stdout.readline().endswith(b"up\n")
        ranks = children(launcher.pid)
        assert sorted(ranks) == [0, 1]
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in ranks.values()):
            assert time.monotonic() < deadline, f"ranks {ranks} outlived the launcher"
            time.sleep(0.05)
    finally:
        launcher.kill()
        for pid in ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_nothing_a_rank_started_outlives_the_launch(tmp_path):
    """A process a rank started (in the rank's process group: a data server, a shell's
    child) ends with the launch, also when the rank itself exited 0; the ranks are
    reaped before the launcher exits."""
    done = run_script(
        tmp_path,
        """
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("child", child.pid, flush=True)
        """,
        ["--nprocs", "2"],
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    pids = [int(line.split()[-1]) for line in done.stdout.splitlines() if " child " in line]
    assert len(pids) == 2
    deadline = time.monotonic() + 10  # SIGKILL is sent before the launcher exits
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"{pids} outlived the launch"
        time.sleep(0.05)


@pytest.mark.devices(2, processes=2)
def test_the_step_counts_host_data_as_each_process_share():
    """On 2 processes x 2 devices (jaxdp's pytest plugin): 8 rows here are 16 in all, and
    a share that makes no whole global batch is refused naming both counts (no collective)."""
    import jax.numpy as jnp
    import optax

    mesh = jaxdp.initialize()  # the runtime is up: the global mesh of 4 devices
    step = jaxdp.make_train_step(lambda p, b: jnp.mean(b @ p), optax.sgd(0.1), mesh=mesh)
    assert tuple(step.sizes(np.zeros((8, 3)))) == (4, 1, 4, 16)
    refused = (
        "this process's batch has 3 rows; 2 processes make a global batch of 6 rows: "
        "global_batch_size=6 must be a positive multiple of num_devices * accum_steps = 4 * 1"
    )
    with pytest.raises(ValueError, match=re.escape(refused)):
        step.sizes(np.zeros((3, 3)))


@pytest.mark.devices(2, processes=2)
def test_aux_metrics_average_over_every_process_as_the_loss():
    """has_aux on 2 processes x 2 devices, multisteps, weighted: each process passes its
    share, and metrics["aux"] is the total over all 4 devices' rows over the total count
    (issue 26, item 1)."""
    import jax
    import jax.numpy as jnp
    import optax

    mesh = jaxdp.initialize()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(2, 16, 3)), rng.normal(size=(2, 16))  # two micro-batches

    def loss(w, batch):
        err = batch[0] @ w - batch[1]
        return (jnp.sum(err**2), err.shape[0]), {"close": jnp.sum(jnp.abs(err) < 1)}

    step = jaxdp.make_train_step(
        loss,
        optax.sgd(0.1),
        mesh=mesh,
        accum_steps=2,
        path="multisteps",
        loss_reduction="weighted",
        has_aux=True,
    )
    share = slice(8 * jax.process_index(), 8 * (jax.process_index() + 1))
    state = step.init(np.zeros(3), batch=(x[0][share], y[0][share]))
    for i in range(2):
        state, metrics = step(state, (x[i][share], y[i][share]))
    assert bool(metrics["emitted"])
    assert float(metrics["aux"]["close"]) == pytest.approx(np.mean(np.abs(y) < 1), rel=1e-6)
    assert float(metrics["loss"]) == pytest.approx(np.mean(y**2), rel=1e-6)


def test_an_uncaught_exception_on_one_of_two_processes_ends_the_launch_at_once(tmp_path):
    # Without jaxdp launch's rank wrapper (jaxdp/cli/_rank.py), rank 1 would sit in JAX's
    # shutdown barrier for timeout_s (300 s here) while rank 0 blocks in its collective.
    start = time.monotonic()
    done = run_script(
        tmp_path,
        """
        import jax, jax.numpy as jnp, numpy as np
        import jaxdp
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = jaxdp.initialize()
        total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), np.ones(2))
        for i in range(10**6):
            if i == 3 and jax.process_index() == 1:
                raise RuntimeError("rank 1 fails here")
            assert float(total(x)) == 4.0
        """,
        ["--nprocs", "2", "--devices-per-process", "2", "--timeout-s", "300"]
        + ["--grace-s", str(GRACE_S)],
        timeout=400,
    )
    took = time.monotonic() - start
    assert done.returncode == 1
    assert "[rank 1] RuntimeError: rank 1 fails here" in done.stderr
    assert "[rank 1] jaxdp: process 1 ends on this RuntimeError at once" in done.stderr
    assert "jaxdp launch: failed: rank 1 exited with status 1" in done.stderr
    # About 15 s on 2 busy cores, start-up included; the wait it replaces is 300 s alone.
    assert took < 150


def test_a_sys_exit_on_one_rank_ends_the_launch_at_once_with_its_status(tmp_path):
    """``sys.exit(3)`` on rank 1 while rank 0 waits in a collective: JAX's shutdown
    barrier held rank 1 for timeout_s, then aborted it (134); the 3 was lost (23.6)."""
    start = time.monotonic()
    done = run_script(
        tmp_path,
        """
        import sys
        import jax, jax.numpy as jnp, numpy as np
        import jaxdp
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = jaxdp.initialize()
        total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), np.ones(2))
        for i in range(10**6):
            if i == 3 and jax.process_index() == 1:
                sys.exit(3)
            float(total(x))
        """,
        ["--nprocs", "2", "--devices-per-process", "1", "--timeout-s", "300"]
        + ["--grace-s", str(GRACE_S)],
        timeout=200,
    )
    took = time.monotonic() - start
    assert done.returncode == 3, done.stderr[-2000:]
    # Rank 0's collective failed when rank 1 ended; the launcher may reap it first, but
    # rank 1 recorded the start of its failure before it ended (jaxdp.cli._launch_link).
    assert re.search(r"^jaxdp launch: rank 1 \(pid \d+\) exited with status 3", done.stderr, re.M)
    assert "jaxdp launch: failed: rank 1 exited with status 3" in done.stderr
    assert took < 60  # about 12 s on 2 busy cores; the barrier alone would take 300


def test_a_busy_coordinator_port_is_one_line_not_a_crash(tmp_path):
    """Process 0 on a port another program listens on: JAX's coordinator crashed the
    process (139) after one gRPC log line (23.6)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**os.environ, "JAXDP_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"}
        env.update(JAXDP_NUM_PROCESSES="2", JAXDP_PROCESS_ID="0", JAXDP_CPU_DEVICES="1")
        done = subprocess.run(
            [sys.executable, "-m", "jaxdp", "train", "--steps", "1"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr == (
        f"jaxdp train: error: JAXDP_COORDINATOR_ADDRESS='127.0.0.1:{port}': process 0 runs "
        f"the coordinator on port {port}, which is in use on this machine (Address already in "
        "use); choose a free port\n"
    )


def test_with_the_watch_off_a_stopped_rank_is_named_not_the_peer_jax_aborts(tmp_path):
    """Issue 33.4: with --hang-timeout-s 0, JAX's heartbeat aborts the healthy peer of a
    SIGSTOPped rank (SIGABRT), and the launcher named the peer; it names the stopped rank
    (its state in /proc) and kills it. The abort is simulated: the peer aborts once it
    sees the other stopped, without JAX's 20 s and more."""
    done = run_script(
        tmp_path,
        f"""
        import os, pathlib, signal, time
        mark = pathlib.Path({str(tmp_path)!r}) / "stopped.pid"
        if os.environ["JAXDP_PROCESS_ID"] == "0":
            mark.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            while not mark.exists() or not mark.read_text():
                time.sleep(0.05)
            stat = pathlib.Path(f"/proc/{{mark.read_text()}}/stat")
            while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
                time.sleep(0.05)
            os.abort()
        """,
        ["--nprocs", "2", "--hang-timeout-s", "0", "--grace-s", str(GRACE_S)],
        timeout=60,
    )
    stopped = int((tmp_path / "stopped.pid").read_text())
    assert done.returncode == 128 + signal.SIGKILL, done.stderr
    assert re.search(
        rf"^jaxdp launch: rank 0 \(pid {stopped}\) stopped answering \(stopped by a signal\)",
        done.stderr,
        re.M,
    ), done.stderr
    assert "jaxdp launch: failed: rank 0 stopped answering (stopped by a signal)" in done.stderr
    assert not alive(stopped)


def test_a_rank_still_starting_is_not_called_hung_and_its_usage_error_wins(tmp_path):
    """Issue 33.7: at load 10, --hang-timeout-s 2 called a rank still importing JAX hung
    (137), hiding its usage error (2). The heartbeat counts once the rank joined the run.
    The loaded start is rank 0's start-up holding the GIL for 3 s (a switch interval of
    10 s keeps the heartbeat thread out), rank 1's a sleep as long (issue 31: it held the
    GIL too, 3 CPU s more), then a usage error, before any jaxdp.initialize."""
    done = run_script(
        tmp_path,
        """
        import os, sys, time
        sys.setswitchinterval(10)
        end = time.monotonic() + 3
        while time.monotonic() < end:
            if os.environ["JAXDP_PROCESS_ID"] == "1":
                time.sleep(max(0.0, end - time.monotonic()))
        sys.setswitchinterval(0.005)
        print("script: error: --flag 7 must be even", file=sys.stderr)
        sys.exit(2)
        """,
        ["--nprocs", "2", "--hang-timeout-s", "1", "--grace-s", str(GRACE_S)],
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "stopped answering" not in done.stderr
    assert "[rank 0] script: error: --flag 7 must be even" in done.stderr.splitlines()


def train_as(rank, port, **env):
    """`jaxdp train` as process ``rank`` of 2, started by hand (no launcher), on ``port``."""
    env = {**os.environ, "JAXDP_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", **env}
    env.update(JAXDP_NUM_PROCESSES="2", JAXDP_PROCESS_ID=str(rank), JAXDP_CPU_DEVICES="1")
    command = [sys.executable, "-m", "jaxdp", "train", "--steps", "1", "--no-compile-cache"]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def test_a_busy_coordinator_port_ends_process_1_with_one_line_too(tmp_path):
    """Issue 33.4: process 1 given a port another program listens on waited the whole
    timeout, then JAX aborted it (134, a native stack). It asks the port first: no answer
    to an HTTP/2 preface in PROBE_S (5 s) is no JAX coordinator. A listening socket
    that never accepts is the worst case: it is silent, so this waits those 5 s."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out, err = train_as(1, port).communicate(timeout=120)
    assert err == (
        f"jaxdp train: error: JAXDP_COORDINATOR_ADDRESS='127.0.0.1:{port}': process 1 of 2 "
        f"found a program on port {port} that is not JAX's coordinator (no answer to an "
        "HTTP/2 preface in 5 s); process 0 cannot run the coordinator on a port in use: give "
        "every process the same free port\n"
    )
    assert "held-out accuracy" not in out


def test_processes_given_different_ports_end_with_one_line_each_before_jax_aborts():
    """Issue 33.4: each waited JAXDP_TIMEOUT_S for the other, then JAX aborted both (134).
    Each ends at that deadline with status 2 and one line; JAX's own comes 5 s later."""
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    ranks = [train_as(rank, ports[rank], JAXDP_TIMEOUT_S="3") for rank in (0, 1)]
    for rank, proc in enumerate(ranks):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err[-3000:]
        assert err == (
            f"jaxdp train: error: process {rank} of 2 waited 3 s (JAXDP_TIMEOUT_S='3') for all "
            f"processes to join at JAXDP_COORDINATOR_ADDRESS='127.0.0.1:{ports[rank]}', in "
            "vain: a process never started or died while starting, or the processes were "
            "given different addresses (each needs process 0's); nothing was trained\n"
        )


JOINS = "import jaxdp\njaxdp.initialize()\nprint('joined', flush=True)\n"


def script_as(tmp_path, rank, port, code=JOINS, **env):
    """A user's script (default: one that joins), as ``jaxdp launch`` runs it (through
    _rank.py) as process ``rank`` of 2, on ``port``."""
    script = tmp_path / "joins.py"
    script.write_text(code)
    env = {**os.environ, "JAXDP_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", **env}
    env.update(JAXDP_NUM_PROCESSES="2", JAXDP_PROCESS_ID=str(rank), JAXDP_CPU_DEVICES="1")
    env[ENV_FAILURE_FILE] = str(tmp_path / f"failure-{rank}")
    command = [sys.executable, str(ROOT / "jaxdp" / "cli" / "_rank.py"), str(script)]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def test_a_launched_script_given_a_busy_coordinator_port_ends_process_1_with_one_line(
    tmp_path,
):
    """Issue 33.4, a user's script under jaxdp launch: process 1 waited the timeout in
    its jaxdp.initialize, then JAX aborted it (134). The rank wrapper asks the port
    before the script runs, as jaxdp train does (a silent listener: PROBE_S, 5 s)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = script_as(tmp_path, 1, port)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-3000:]
    assert err == (
        f"jaxdp launch: error: JAXDP_COORDINATOR_ADDRESS='127.0.0.1:{port}': process 1 of 2 "
        f"found a program on port {port} that is not JAX's coordinator (no answer to an "
        "HTTP/2 preface in 5 s); process 0 cannot run the coordinator on a port in use: give "
        "every process the same free port\n"
    )
    assert out == ""  # the script never ran
    assert read_failure(tmp_path / "failure-1").status == 2


def test_launched_scripts_given_different_ports_end_with_one_line_each_before_jax_aborts(
    tmp_path,
):
    """Issue 33.4, a user's script under jaxdp launch: each rank waited JAXDP_TIMEOUT_S in
    jaxdp.initialize, then JAX aborted it (134). The wrapper's watchdog ends each at that
    deadline with status 2 and one line; JAX's own comes 5 s later."""
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    ranks = [script_as(tmp_path, rank, ports[rank], JAXDP_TIMEOUT_S="3") for rank in (0, 1)]
    for rank, proc in enumerate(ranks):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err[-3000:]
        assert err == (
            f"jaxdp launch: error: process {rank} of 2 waited 3 s (JAXDP_TIMEOUT_S='3') for "
            f"all processes to join at JAXDP_COORDINATOR_ADDRESS='127.0.0.1:{ports[rank]}', "
            "in vain: a process never started or died while starting, or the processes were "
            "given different addresses (each needs process 0's); the script stopped in "
            "jaxdp.initialize\n"
        )
        assert "joined" not in out
        assert read_failure(tmp_path / f"failure-{rank}").status == 2


def test_the_join_watchdog_sees_a_wait_that_begins_as_it_asks_whether_the_run_is_up():
    """A CI run on a loaded machine: the watchdog looked for the wait, then asked whether
    the run was up; the wait began (and JAX's client came) in between, so it took the run
    for joined and the rank ran on to JAX's abort (-6). Here the wait begins within that
    ask, every time: the watchdog still gives up at the wait's timeout_s."""
    from jaxdp.cli import _rank

    def begins_the_wait():
        wait = threading.Timer(30, lambda: None)
        wait.name, wait.daemon = "jaxdp-join", True
        wait.timeout_s, wait.timeout_source = 0.2, "JAXDP_TIMEOUT_S='0.2'"
        wait.start()
        link.joined = lambda: True  # JAX's client exists from here on
        return True

    said = []
    link = types.SimpleNamespace(
        joined=begins_the_wait,
        never_joined=lambda who, address, timeout_s, source: f"{who} {address} {source}",
        give_up=lambda prog, text: said.append((prog, text)),
    )
    _rank._watch_the_join(link, "process 1 of 2", "127.0.0.1:1")
    (wait,) = [t for t in threading.enumerate() if t.name == "jaxdp-join"]
    wait.cancel()
    assert said == [
        (
            "jaxdp launch",
            "process 1 of 2 127.0.0.1:1 JAXDP_TIMEOUT_S='0.2'; the script stopped in "
            "jaxdp.initialize",
        )
    ]


def test_a_launched_script_is_not_ended_before_it_begins_to_join(tmp_path):
    """The wrapper's join watchdog arms only once jaxdp.initialize waits: a rank that
    works past JAXDP_TIMEOUT_S first (here it never joins: it needs no peers) runs on."""
    code = "import time\ntime.sleep(4)\nprint('worked', flush=True)\n"
    proc = script_as(tmp_path, 1, 1, code, JAXDP_TIMEOUT_S="1")  # nothing listens on port 1
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, out, err) == (0, "worked\n", "")


RESTARTS = """
import os, pathlib, signal, sys, time
restart, rank = int(os.environ["JAXDP_RESTART_COUNT"]), int(os.environ["JAXDP_PROCESS_ID"])
print("start", restart, os.getpid(), flush=True)
# Rank 0 has printed its start before rank 1 dies: else, on a loaded machine, the group
# could be stopped before rank 0 got that far (a CI run saw its start 0 missing).
started = pathlib.Path(__file__).with_name(f"started-{restart}-{rank}")
started.touch()
if (restart, rank) == (0, 1):
    for _ in range(600):
        if started.with_name("started-0-0").exists():
            break
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
if (restart, rank) == (1, 0):
    print("exits", time.time(), flush=True)
    sys.exit(5)
time.sleep(60 if restart == 1 else 1)  # rank 1 of the second start stays until stopped
"""


def rank_pids(stdout):
    return [int(line.split()[-1]) for line in stdout.splitlines() if " start " in line]


@pytest.mark.parametrize("max_restarts", [1, 2])
def test_max_restarts_restarts_the_group_and_past_them_exits_with_the_last_failure(
    tmp_path, max_restarts
):
    """torchrun's --max-restarts: rank 1 is killed in the first start, rank 0 exits 5 in
    the second; with 2 restarts the third start finishes (exit 0), with 1 the launch
    ends with status 5 naming rank 0, within seconds of that exit (issue 25)."""
    done = run_script(
        tmp_path,
        RESTARTS,
        ["--nprocs", "2", "--max-restarts", str(max_restarts), "--grace-s", str(GRACE_S)],
        timeout=120,
    )
    ended = time.time()
    starts = [line.split()[3] for line in done.stdout.splitlines() if "[rank 0] start " in line]
    assert starts == ["0", "1", "2"][: max_restarts + 1]  # JAXDP_RESTART_COUNT
    cause = re.compile(
        rf"^jaxdp launch: restart (\d) of {max_restarts}: rank (\d) exited with status "
        r"(\d+)\S* ?\S* at \d\d:\d\d:\d\d; the group was down (\d+\.\d) s$",
        re.M,
    )
    found = cause.findall(done.stderr)
    assert [f[:3] for f in found] == [("1", "1", "137"), ("2", "0", "5")][:max_restarts]
    assert all(float(f[3]) < 10 for f in found), found  # stopped, reaped, started again
    if max_restarts == 2:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode == 5
        assert done.stderr.endswith(
            "jaxdp launch: failed: rank 0 exited with status 5 (1 of --max-restarts 1 used)\n"
        )
        (exited,) = [float(x.split()[-1]) for x in done.stdout.splitlines() if " exits " in x]
        assert ended - exited < GRACE_S + 10  # rank 1 ignores nothing: SIGTERM ends it
    for pid in rank_pids(done.stdout):
        assert not alive(pid)


# ---- training ---------------------------------------------------------------------------


def children(pid):
    """``{JAXDP_PROCESS_ID: pid}`` of the processes whose parent is ``pid`` (Linux /proc)."""
    found = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != pid:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue  # gone meanwhile
        for item in environ:
            if item.startswith(b"JAXDP_PROCESS_ID="):
                found[int(item.split(b"=")[1])] = int(stat.parent.name)
    return found


def seen(*exits):
    """Exits as the launcher saw them, in this order, at 10 s, 11 s, ...: a status above 128
    is a process killed by that signal, ``"exited 143"`` one that exited with 143."""
    found = []
    for i, (rank, status) in enumerate(exits):
        exited = isinstance(status, str)
        status = int(str(status).removeprefix("exited "))
        found.append(Exit(rank, status, 10.0 + i, killed=status > 128 and not exited))
    return found


@pytest.mark.parametrize(
    ("exits", "records", "named"),
    [
        # CI: rank 1's sys.exit(3) failed rank 0's gloo all-reduce; rank 0 was reaped first.
        (seen((0, 1), (1, 3)), {1: (9.1, 3), 0: (9.2, 1)}, (1, 3)),
        (seen((0, 1)), {1: (9.1, 3), 0: (9.2, 1)}, (1, 3)),  # rank 1 recorded, not yet ended
        (seen((0, 1), (1, 134)), {}, (0, 1)),  # nothing recorded (a program): the order seen
        (seen((1, 139), (0, 1)), {0: (10.5, 1)}, (1, 139)),  # a crash seen before any record
        (seen((1, 139), (0, 1)), {0: (9.5, 1)}, (0, 1)),  # ... after a peer recorded its own
        # A rank killed from outside cannot have died of a peer's failure, whatever the times.
        (seen((0, 1), (1, 137)), {0: (9.0, 1)}, (1, 137)),
        (seen((1, 143), (0, 1)), {}, (1, 143)),
        (seen((1, 0), (0, 2), (2, 1)), {}, (0, 2)),
        (seen((1, 2), (0, 2)), {0: (9.0, 2), 1: (9.0, 2)}, (0, 2)),  # a tie: the lower rank
        (seen((0, 0)), {1: (9.0, 3)}, None),  # no error exit seen yet: nothing to name
        # Issue 44: jaxdp train exits 128 + n after a signal, and so do the peers that stop
        # with it (143): the rank that got it recorded when it came, they when they ended.
        (seen((0, "exited 143"), (1, "exited 143")), {1: (9.0, 143), 0: (9.5, 143)}, (1, 143)),
        (seen((0, "exited 143"), (1, "exited 130")), {1: (9.0, 130), 0: (9.5, 143)}, (1, 130)),
        (seen((0, "exited 143"), (1, 137)), {0: (9.0, 143)}, (1, 137)),  # a SIGKILL still first
    ],
)
def test_the_rank_whose_failure_began_first_is_named(exits, records, named):
    """The ordering rule of jaxdp launch (issue 23.6): a rank's own record of when its
    failure began decides over the order the launcher reaped the exits in."""
    records = {rank: FailureRecord(*record) for rank, record in records.items()}
    assert first_to_fail(exits, records) == named


def test_the_launcher_reads_the_ranks_records_and_waits_briefly_for_them(tmp_path, monkeypatch):
    """Records written by record_failure (the first of a process stands) are read from
    the files the launcher names; with a rank neither ended nor recorded, the launcher
    waits up to RECORD_WAIT_S after the first error exit before naming one."""
    group = Group(io.BytesIO(), io.BytesIO(), tmp_path, watch=False)
    # Stand-ins, counted and looked up in /proc (running: this process), never signalled.
    group.procs = [types.SimpleNamespace(pid=os.getpid())] * 3
    monkeypatch.setenv(ENV_FAILURE_FILE, str(group.failure_file(2)))
    record_failure(3)
    record_failure(1)  # a later failure of the same process: the first stands
    assert read_failure(group.failure_file(2)).status == 3
    now = time.monotonic()  # after rank 2's record
    group.exits = [Exit(0, 1, now)]  # rank 1: neither ended nor recorded
    assert group._first_failure() is None  # waiting for its record
    assert group._first_failure(final=True)[:2] == (2, 3)  # every rank ended: no wait
    group.exits = [Exit(0, 1, now), Exit(1, 0, now)]
    assert group._first_failure()[:2] == (2, 3)  # every rank ended or recorded: no wait
    group.exits = [Exit(0, 1, now - 2 * RECORD_WAIT_S)]  # before rank 2's record
    assert group._first_failure()[:2] == (0, 1)  # waited long enough for rank 1
    assert read_failure(tmp_path / "absent") is None


def test_a_rank_that_exits_with_a_signals_status_is_named_by_its_record(tmp_path):
    """Issue 44, item 4: jaxdp train exits 128 + n after signal n, and the peers that stop
    with it at the same call exit 143; the launcher took every such status for a kill from
    outside and named whichever it reaped first (rank 0 for a SIGTERM to rank 1). The rank
    that got the signal recorded when it came (as jaxdp train's handler does), the peer
    when it exited: the earlier record is named."""
    done = run_script(
        tmp_path,
        """
        import os, sys, time
        from jaxdp.cli._launch_link import record_failure
        if os.environ["JAXDP_PROCESS_ID"] == "1":
            record_failure(143)  # SIGTERM came: it stops with its peer, and ends later
            time.sleep(2)
        else:
            time.sleep(0.5)  # it stopped because rank 1 did, and ends first
        sys.exit(143)
        """,
        ["--nprocs", "2", "--grace-s", "30"],
        timeout=120,
    )
    assert done.returncode == 143, done.stderr
    assert re.search(r"^jaxdp launch: rank 1 \(pid \d+\) exited with status 143", done.stderr, re.M)
    assert "jaxdp launch: failed: rank 1 exited with status 143 (SIGTERM)" in done.stderr


def test_a_rank_that_has_ended_is_never_hung(tmp_path):
    """Issue 44, item 4: under load the waiter of a rank that had ended had not yet recorded
    its exit, and a heartbeat older than --hang-timeout-s named it hung (2 of 4 runs at
    load 30 with 2 s). Ended, not yet reaped (a zombie), its heartbeat a minute old: not
    hung."""
    group = Group(io.BytesIO(), io.BytesIO(), tmp_path, watch=True)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended, left unreaped
    group.procs = [proc]
    beat = group.heartbeat(0)
    beat.touch()
    os.utime(beat, (time.time() - 60,) * 2)
    try:
        assert group._hung(2.0) is None
        assert group._hung(None) is None
    finally:
        proc.wait()


def test_a_rank_whose_work_is_done_is_not_hung_while_it_exits(tmp_path):
    """Issue 44, item 4: a finished run's rank was called hung under load (exit 137): its
    exit (JAX's shutdown, interpreter teardown) ran without a heartbeat. Here each rank's
    exit holds the GIL for 4 s (a C call through ctypes.PyDLL), so no heartbeat thread
    runs, with --hang-timeout-s 2: the rank stopped beating when its code was done."""
    done = run_script(
        tmp_path,
        """
        import atexit, ctypes
        import jaxdp
        jaxdp.initialize()  # joined: its heartbeat beats
        atexit.register(ctypes.PyDLL(None).sleep, 4)  # with the GIL held
        """,
        ["--nprocs", "2", "--hang-timeout-s", "2"],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "stopped answering" not in done.stderr


def test_the_multi_process_example_runs_unchanged_on_one_process_and_on_two(tmp_path):
    example = str(ROOT / "examples" / "multi_process.py")
    alone = subprocess.run(
        [sys.executable, example], capture_output=True, text=True, timeout=300, check=True
    ).stdout.splitlines()
    command = [*LAUNCH, "--nprocs", "2", "--devices-per-process", "2", "--timeout-s", "60"]
    done = subprocess.run([*command, "--", example], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    launched = [x.removeprefix("[rank 0] ") for x in done.stdout.splitlines()]
    assert alone[0].startswith("processes: 1 x 4 device(s)")
    assert launched[0].startswith("processes: 2 x 2 device(s)")
    assert alone[2] == "this process read 5120 of the 5120 rows of 40 optimizer steps"
    assert launched[2] == "this process read 2560 of the 5120 rows of 40 optimizer steps"
    # float32: the batch, losses and weights as printed (4 and 1 decimals) are the same.
    assert launched[1] == alone[1] and launched[3:] == alone[3:] and len(alone) == 5
    assert len(launched) == 5  # nothing else on stdout: gloo's note is filtered out


class Counting:
    """A record-at-a-time source that records every index read (from any thread)."""

    def __init__(self, x):
        self.x, self.read, self.lock = x, [], threading.Lock()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        with self.lock:
            self.read.append(i)
        return self.x[i]


@pytest.mark.devices(2, processes=2)
def test_the_loader_on_two_processes_reads_only_each_process_rows():
    """jaxdp.data.Loader on 2 processes x 2 devices (jaxdp's pytest plugin): each process
    reads exactly its devices' rows of every call, once, and training through it gives
    the loss one process computes from epoch_schedule's global batches."""
    import jax.numpy as jnp
    import optax

    import jaxdp.data

    mesh = jaxdp.initialize()  # the runtime is up: the global mesh of 4 devices
    sizes = jaxdp.batch_sizes(num_devices=4, accum_steps=2, micro_batch_size=3)
    x = np.arange(50.0)[:, None]
    results = {}
    for path in ("fused", "multisteps"):
        source = Counting(x)
        loader = jaxdp.data.Loader(source, sizes, mesh=mesh, path=path, epochs=2)
        step = jaxdp.make_train_step(
            lambda p, b: jnp.mean(b @ p), optax.sgd(0.1), mesh=mesh, accum_steps=2, path=path
        )
        state, losses = step.init(np.ones(1)), []
        for batch in loader:
            state, metrics = step(state, batch.data, batch.micro_weights)
            if batch.emits:
                losses.append(float(metrics["loss"]))
        results[path] = {"read": sorted(source.read), "losses": losses}
    schedules = [jaxdp.epoch_schedule(50, sizes, epoch=e).rows for e in (0, 1)]
    process = jax.process_index()
    rows = (slice(0, 12), slice(12, 24))[process]
    mine = np.concatenate([s[:, rows].ravel() for s in schedules])
    for path in ("fused", "multisteps"):
        # Each of its rows once per call that holds it, and nothing of the other's.
        assert results[path]["read"] == sorted(mine.tolist())
    # Loss of each step before its update: mean(x @ w) of the global batch; w moves by
    # -0.1 each step (the gradient of mean(x @ w) is mean(x) = the batch's mean row).
    w, expected = 1.0, []
    for global_rows in np.concatenate(schedules):
        expected.append(float(np.mean(global_rows * w)))
        w -= 0.1 * float(np.mean(global_rows))
    for path in ("fused", "multisteps"):
        np.testing.assert_allclose(results[path]["losses"], expected, rtol=1e-6)


# ---- restarts, hangs, preemption (issue 25) ---------------------------------------------

STEPS = 10
# float64 and ZeRO stage 1: the uninterrupted run is also
# test_train_on_two_processes_equals_one_process_with_four_devices's.
TRAIN_FLAGS = ["--steps", str(STEPS), "--checkpoint-every", "2", "--precision", "float64"]
TRAIN_FLAGS += ["--zero-stage", "1"]
LAUNCH_2X2 = [*LAUNCH, "--nprocs", "2", "--devices-per-process", "2", "--timeout-s", "60"]
# Run by every rank of `launched`: appends the coordinator address the launcher gave it
# to $COORDINATORS, then runs jaxdp train, with what $KILLS names for a start, {"restart":
# [rank, step, where]}, done by that rank: "step", a SIGKILL of itself after the update
# of that optimizer step; "save", a SIGKILL of itself while that step's checkpoint is
# being written (this rank's part written, the checkpoint not yet committed: before
# orbax's "save" barrier); "term", a SIGTERM to the launcher after that update (a
# scheduler's preemption), the rank going on once the launcher has forwarded it, so
# that the run stops at that call; "stop", a SIGSTOP of itself after that update, its
# pid and the time (time.monotonic) written to $STOPS first; "int", a SIGINT to itself
# after that update (a Ctrl-C meant for that rank alone). Rank 0 of a restart first
# copies the metrics the starts before it left ($RECORDS) to $RECORDS.<restart count>.
RANK = """
import json, os, shutil, signal, sys, time
from orbax.checkpoint._src.multihost import multihost
from jaxdp.checkpoint._checkpoints import Checkpoints
from jaxdp.cli import _train, main

with open(os.environ["COORDINATORS"], "a") as f:
    f.write(os.environ["JAXDP_COORDINATOR_ADDRESS"] + "\\n")
restart = os.environ["JAXDP_RESTART_COUNT"]
if os.environ["JAXDP_PROCESS_ID"] == "0" and os.path.exists(os.environ["RECORDS"]):
    shutil.copy(os.environ["RECORDS"], os.environ["RECORDS"] + "." + restart)
kill = json.loads(os.environ["KILLS"]).get(restart)
if kill and int(os.environ["JAXDP_PROCESS_ID"]) == kill[0]:
    _, at, where = kill
    if where in ("step", "term", "stop", "int"):
        updated = _train.Run._updated

        def _updated(self, batch, metrics, progress, *rest):
            updated(self, batch, metrics, progress, *rest)
            if progress.done != at:
                return
            if where == "step":
                os.kill(os.getpid(), signal.SIGKILL)
            elif where == "int":
                os.kill(os.getpid(), signal.SIGINT)
            elif where == "term":
                # jaxdp train's handler gives way to the one before it once it has run.
                handler = signal.getsignal(signal.SIGTERM)
                os.kill(os.getppid(), signal.SIGTERM)
                for _ in range(6000):
                    if signal.getsignal(signal.SIGTERM) is not handler:
                        break
                    time.sleep(0.01)
            else:
                with open(os.environ["STOPS"], "w") as f:
                    f.write(f"{os.getpid()} {time.monotonic()}")
                os.kill(os.getpid(), signal.SIGSTOP)

        _train.Run._updated = _updated
    else:
        save, sync, saving = Checkpoints.save, multihost.sync_global_processes, []

        def _save(self, state, **kwargs):
            saving[:] = [int(state.step)]
            return save(self, state, **kwargs)

        def _sync(key, *args, **kwargs):
            if saving == [at] and "Checkpointer:save" in key and "start" not in key:
                os.kill(os.getpid(), signal.SIGKILL)
            return sync(key, *args, **kwargs)

        Checkpoints.save, multihost.sync_global_processes = _save, _sync
status = main(["train", *sys.argv[1:]])
if kill and kill[2] == "int" and int(os.environ["JAXDP_PROCESS_ID"]) == kill[0]:
    time.sleep(1)  # the rank the signal reached ends after its peer, as in issue 44's trial
sys.exit(status)
"""


def launched(tmp_path, name, launch_flags=(), *, resume=False, kills=None, train=TRAIN_FLAGS):
    """A ``jaxdp launch`` of ``train`` (ranks: RANK) writing to ``tmp_path / name``
    (checkpoints), ``name.jsonl`` (metrics) and ``name.summary.json``; a Popen. Its
    ``mark`` is in the environment of the launcher and every rank (:func:`left_behind`),
    its ranks' coordinator addresses go to ``name.coordinators``
    (:func:`assert_ports_free`), and a rank's "stop" ($KILLS) to ``name.stopped``."""
    rank = tmp_path / "rank.py"
    rank.write_text(RANK)
    flags = [*train, "--checkpoint-dir", str(tmp_path / name)]
    flags += ["--summary-out", str(tmp_path / f"{name}.summary.json")]
    flags += ["--metrics-out", str(tmp_path / f"{name}.jsonl")] + ["--resume"] * resume
    # tmp_path is this test's own, also among pytest-xdist's workers running at once.
    mark = str(tmp_path / name)
    env = {**os.environ, "JAXDP_TEST_MARK": mark, "KILLS": json.dumps(kills or {})}
    env["COORDINATORS"] = str(tmp_path / f"{name}.coordinators")
    env["STOPS"] = str(tmp_path / f"{name}.stopped")
    env["RECORDS"] = str(tmp_path / f"{name}.jsonl")
    launcher = subprocess.Popen(
        [*LAUNCH_2X2, *launch_flags, "--", str(rank), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    launcher.mark = mark
    return launcher


def metrics(path):
    """Per-step loss and grad norm, as written (JSON floats: bitwise)."""
    lines = path.read_text().splitlines()
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines)]


def newest_leaves(directory):
    """The SHA-256 of every array of the newest checkpoint in ``directory``."""
    newest = max(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    meta = json.loads((directory / str(newest) / "meta" / "metadata").read_text())
    return newest, {name: leaf["sha256"] for name, leaf in meta["leaves"].items()}


def assert_ports_free(tmp_path, name):
    """Every coordinator port of launch ``name`` can be bound and listened on again, as a
    new coordinator would (SO_REUSEADDR, as gRPC sets: connections of the dead
    coordinator in TIME_WAIT do not hold the port); fails while anything holds it: a
    coordinator, the launcher's reservation, any socket bound there. Returns the
    addresses the ranks got, one per rank and start."""
    addresses = (tmp_path / f"{name}.coordinators").read_text().split()
    for port in sorted({int(address.rsplit(":", 1)[1]) for address in addresses}):
        for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "127.0.0.1")):
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, port))
                except OSError as e:
                    raise AssertionError(f"port {port} ({host}) is still held: {e}") from None
                s.listen()
    return addresses


# The tests that read `uninterrupted` run on one worker under pytest-xdist, so its launch
# (about 20 CPU s) is made once, not once per worker that gets one of them.
restarts_group = pytest.mark.xdist_group("restarts")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """An uninterrupted run, 2 processes x 2 devices: its folder (``ref``, ``ref.jsonl``,
    ``ref.summary.json``), stdout, metrics and newest checkpoint's leaves."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    launcher = launched(tmp_path, "ref")
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-4000:]
    assert not err.count("jaxdp launch: failed"), err[-4000:]
    return types.SimpleNamespace(
        path=tmp_path,
        out=out,
        metrics=metrics(tmp_path / "ref.jsonl"),
        leaves=newest_leaves(tmp_path / "ref"),
    )


@restarts_group
def test_train_on_two_processes_equals_one_process_with_four_devices(tmp_path, uninterrupted):
    """``jaxdp train`` under ``jaxdp launch`` (the restarts' uninterrupted run, below; issue
    31: it was a launch of its own): 2 processes x 2 devices, gloo, the optimizer state
    split over them (ZeRO stage 1, every process saving its shards), against one process
    with 4 devices at stage 0."""
    out = uninterrupted.out.splitlines()
    assert "[rank 0] processes: 2, each feeding 64 rows per step to its 2 device(s)" in out
    # Only process 0 prints; gloo's connection note stays out of the ranks' stdout.
    assert not [x for x in out if x.startswith("[rank 1]")]
    assert not [x for x in out if "Gloo" in x or "peer ranks" in x]
    summary = json.loads((uninterrupted.path / "ref.summary.json").read_text())
    assert summary["steps"] == STEPS
    there = [
        json.loads(line) for line in (uninterrupted.path / "ref.jsonl").read_text().splitlines()
    ]

    config = TrainConfig(
        num_devices=4,
        steps=STEPS,
        precision="float64",
        checkpoint_dir=str(tmp_path / "here"),
        metrics_out=str(tmp_path / "m_here"),
    )
    # Held-out accuracy over 2 processes' devices (jaxdp.data.evaluate): the same count.
    assert train(config)["test_accuracy"] == summary["test_accuracy"]
    here = [json.loads(line) for line in (tmp_path / "m_here").read_text().splitlines()]
    assert [r["step"] for r in there] == [r["step"] for r in here] == list(range(1, STEPS + 1))
    assert [r["samples"] for r in there] == [r["samples"] for r in here]  # all processes'
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            [r[name] for r in there], [r[name] for r in here], rtol=TOLERANCES["float64"].rtol
        )
    step, sizes = make_step(config)
    ours = jaxdp.checkpoint.Checkpoints(tmp_path / "here").restore(
        step.init(build(config)), sizes=sizes
    )
    split = dataclasses.replace(config, zero_stage=1)
    step, sizes = make_step(split)
    like = step.init(build(split))
    theirs = jaxdp.checkpoint.Checkpoints(uninterrupted.path / "ref").restore(like, sizes=sizes)
    assert_trees_close(
        theirs.state.params, ours.state.params, rtol=TOLERANCES["float64"].rtol, atol=0.0
    )


def wait_for_records(launcher, path, count, timeout=240):
    deadline = time.monotonic() + timeout
    while not (path.exists() and len(path.read_text().splitlines()) >= count):
        assert launcher.poll() is None, launcher.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)


@restarts_group
def test_three_kills_a_sigterm_and_a_stopped_rank_end_bitwise_as_an_uninterrupted_run(
    tmp_path, uninterrupted
):
    """Acceptance 1, 2 and 4 of issue 25 on one run, in two launches (issue 31: four tests
    in five). The first, ``--max-restarts 3``: rank 0 killed after the first optimizer
    step, before the first checkpoint (every 2 steps): the restarted group starts fresh
    over the records its first start wrote (after the launch began: its own); then a
    random rank SIGKILLed at a random step, and a random rank SIGKILLed while a checkpoint
    is being written, each restart resuming (no --resume typed). The peer of each,
    blocked in a gloo collective or orbax's barrier, cannot act on SIGTERM: with JAX's
    heartbeat and the launcher's grace both at a minute, only the launcher's SIGKILL
    after a second ends it quickly. Then, no restart left, a scheduler's SIGTERM to the
    launcher: every rank stops at the same optimizer step (the processes agree on each
    call's stop), saves it and the launch exits 143. The requeued launch (the same
    command with --resume, ``--max-restarts 1``): a random rank SIGSTOPs itself (its peer
    blocked in a collective, JAX's own heartbeat at 60 s); the launcher's heartbeat watch
    finds it, names it and restarts the group, and the run ends as the uninterrupted
    one, bitwise. Prints the detection time that docs/scaling-out.md quotes."""
    seed = int(time.time())
    rng = np.random.default_rng(seed)
    first, second = int(rng.integers(3, 6)), int(rng.choice([6, 8]))
    ranks = [0, *(int(r) for r in rng.integers(0, 2, size=4))]
    # The third restart resumes from step second - 2, the newest committed checkpoint.
    kills = {"0": [0, 1, "step"], "1": [ranks[1], first, "step"], "2": [ranks[2], second, "save"]}
    kills["3"] = [ranks[3], second - 1, "term"]
    print(f"seed {seed}: kills {kills}")
    flags = ["--max-restarts", "3", "--grace-s", "60", "--heartbeat-timeout-s", "60"]
    launcher = launched(tmp_path, "run", flags, kills=kills)
    out, err = launcher.communicate(timeout=400)
    assert launcher.returncode == 128 + signal.SIGTERM, (kills, err[-4000:])
    for restart, (rank, _, _) in enumerate(list(kills.values())[:3], 1):
        down = re.search(
            rf"^jaxdp launch: restart {restart} of 3: rank {rank} exited with status 137 "
            r"\(SIGKILL\) at [\d:]+; the group was down ([\d.]+) s$",
            err,
            re.M,
        )
        assert down, (kills, err[-4000:])
        # About 1.5 s measured; far from the 60 s either timeout would take.
        assert float(down[1]) < 30, (kills, err[-4000:])
    killed = r"^jaxdp launch: rank (\d) \(pid \d+\) exited with status 137 \(SIGKILL\)"
    assert re.findall(killed, err, re.M) == [str(k[0]) for k in list(kills.values())[:3]]
    fresh = f"[rank 0] --resume: no checkpoint in {tmp_path / 'run'} yet; starting a fresh"
    assert out.count(fresh) == 1, (kills, out[-4000:])  # the first restart only
    stops = re.findall(
        r"^\[rank (\d)\] jaxdp train: process \d stopped at optimizer step (\d+) \((.*)\); "
        r"checkpoint (\S+)$",
        err,
        re.M,
    )
    assert sorted(rank for rank, *_ in stops) == ["0", "1"], (kills, err[-4000:])
    assert len({tuple(rest) for _, *rest in stops}) == 1, stops  # the same step and place
    step, _, checkpoint = stops[0][1:]
    assert newest_leaves(tmp_path / "run")[0] == int(step) < STEPS
    assert pathlib.Path(checkpoint) == tmp_path / "run" / step
    assert left_behind(launcher.mark) == []
    assert len(assert_ports_free(tmp_path, "run")) == 2 * 4  # 2 ranks, 4 starts

    hang_timeout_s, victim = 5, ranks[4]
    flags = ["--max-restarts", "1", "--hang-timeout-s", str(hang_timeout_s)]
    kills = {"0": [victim, int(step) + 1, "stop"]}
    again = launched(tmp_path, "run", flags, resume=True, kills=kills)
    err = Lines(again.stderr)
    try:
        again.wait(timeout=300)
    finally:
        if again.poll() is None:
            again.kill()
    err.thread.join(timeout=10)
    assert again.returncode == 0, (kills, "".join(x for _, x in err.lines)[-4000:])
    pid, stopped = (tmp_path / "run.stopped").read_text().split()
    found, line = err.first(
        rf"^jaxdp launch: rank {victim} \(pid {pid}\) stopped answering: no "
        r"heartbeat for [\d.]+ s \(stopped by a signal\); stopping the other 1 rank\(s\) "
        r"\(SIGKILL\)$"
    )
    restarted, _ = err.first(rf"^jaxdp launch: restart 1 of 1: rank {victim} stopped answering")
    detection, down = found - float(stopped), restarted - found
    # The last beat came up to a second before the stop.
    assert hang_timeout_s - 1.5 <= detection < hang_timeout_s + 10, detection
    print(f"SIGSTOP of rank {victim}: found in {detection:.1f} s, restarted {down:.1f} s later")
    assert metrics(tmp_path / "run.jsonl") == uninterrupted.metrics
    assert newest_leaves(tmp_path / "run") == uninterrupted.leaves
    assert left_behind(again.mark) == []
    assert len(assert_ports_free(tmp_path, "run")) == 2 * 4 + 2 * 2  # and 2 starts


def test_sigint_to_one_rank_of_jaxdp_train_names_that_rank_and_signal(tmp_path):
    """Issue 44, item 4: a Ctrl-C meant for rank 1 alone stops every rank at the same step
    with a checkpoint (as before), and the launcher names rank 1 and SIGINT and exits 130
    (it blamed rank 0, which exits 143 for a peer's signal, and exited 143)."""
    launcher = launched(tmp_path, "run", kills={"0": [1, 3, "int"]})
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 128 + signal.SIGINT, err[-4000:]
    assert re.search(
        r"^jaxdp launch: rank 1 \(pid \d+\) exited with status 130 \(SIGINT\)", err, re.M
    )
    assert "jaxdp launch: failed: rank 1 exited with status 130 (SIGINT)" in err
    stops = re.findall(
        r"^\[rank (\d)\] jaxdp train: process \d stopped at optimizer step (\d+)", err, re.M
    )
    assert sorted(stops) == [("0", "3"), ("1", "3")], err[-4000:]
    assert newest_leaves(tmp_path / "run")[0] == 3
    assert left_behind(launcher.mark) == []


# HSDP (issue 32): the scanned GPT at stage 3, each process one shard group of its 2
# devices; small (width 8) and short (4 updates).
HSDP_FLAGS = ["--zero-stage", "3", "--shards", "2", "--hidden", "8", "--micro-batch-size", "4"]
HSDP_FLAGS += ["--steps", "4", "--checkpoint-every", "2"]


def test_an_hsdp_run_killed_and_restarted_ends_bitwise_as_an_uninterrupted_one(tmp_path):
    """Issue 32, acceptance 3: ``jaxdp launch --nprocs 2 --devices-per-process 2 -- train
    --zero-stage 3 --shards 2`` (parameters split within each process's shard group, the
    groups' gradients all-reduced over gloo once per step). Its first start is the
    uninterrupted run: it trains all 4 updates and a random rank is SIGKILLed while the
    last checkpoint is being written. The launcher restarts the group (``--max-restarts
    1``), which resumes from checkpoint 2 and redoes updates 3 and 4: every record equals
    the uninterrupted start's, bitwise (its records copied before the restart wrote any;
    one launch, not two: a stage-3 start costs about 20 CPU s per process)."""
    victim = int(np.random.default_rng().integers(0, 2))
    kills = {"0": [victim, 4, "save"]}
    launcher = launched(tmp_path, "run", ["--max-restarts", "1"], kills=kills, train=HSDP_FLAGS)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, (victim, err[-4000:])
    assert re.search(
        rf"^jaxdp launch: restart 1 of 1: rank {victim} exited with status 137 \(SIGKILL\)",
        err,
        re.M,
    ), err[-4000:]
    lines = out.splitlines()
    hsdp = (
        "[rank 0] zero_stage=3: parameters, gradients, gradient accumulator and optimizer "
        "state split over each of 2 shard groups of 2 device(s), the groups' gradients "
        "all-reduced once per step (HSDP)"
    )
    assert lines.count(hsdp) == 2, out[-4000:]  # the first start and the restart
    resumed = f"[rank 0] resumed from {tmp_path / 'run' / '2'}: step 2, "
    assert [x for x in lines if x.startswith(resumed)], out[-4000:]
    uninterrupted = metrics(tmp_path / "run.jsonl.1")
    assert [step for step, *_ in uninterrupted] == [1, 2, 3, 4]
    assert metrics(tmp_path / "run.jsonl") == uninterrupted
    assert newest_leaves(tmp_path / "run")[0] == 4
    config = json.loads((tmp_path / "run" / "4" / "meta" / "metadata").read_text())
    assert (config["extra"]["config"]["zero_stage"], config["extra"]["config"]["shards"]) == (3, 2)
    assert left_behind(launcher.mark) == []


def test_a_restart_refuses_another_runs_records_as_its_first_start_did(tmp_path):
    """A first start refused for another run's metrics exits 2; its restart, finding no
    checkpoint, starts fresh too, and must refuse them as well (it overwrote them)."""
    metrics = tmp_path / "m.jsonl"
    other = '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n'
    metrics.write_text(other)
    past = time.time() - 60  # written before the launch began
    os.utime(metrics, (past, past))
    flags = ["--steps", "2", "--checkpoint-dir", str(tmp_path / "c"), "--metrics-out", str(metrics)]
    done = subprocess.run(
        [*LAUNCH, "--nprocs", "1", "--devices-per-process", "1", "--max-restarts", "1"]
        + ["--", "train", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-4000:]
    refusal = f"jaxdp train: error: metrics_out={str(metrics)!r} holds 2 record(s) of another run"
    assert done.stderr.count(refusal) == 2, done.stderr[-4000:]  # the first start and the restart
    assert metrics.read_text() == other


class Lines:
    """A pipe's lines as they come, each with the time it was read."""

    def __init__(self, pipe):
        self.lines = []
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe):
        for line in pipe:
            self.lines.append((time.monotonic(), line))

    def first(self, pattern):
        for at, line in self.lines:
            if re.search(pattern, line):
                return at, line
        raise AssertionError(f"no line matches {pattern!r}: {''.join(x for _, x in self.lines)}")


def test_a_hang_past_max_restarts_ends_the_launch_naming_the_stopped_rank(tmp_path):
    """Acceptance 3 and 5 of issue 25 for a hang: a rank SIGSTOPped when no restart is
    left ends the launch with 137 (a rank killed for not answering), naming it, once
    --hang-timeout-s has passed, and leaves no process or port behind."""
    hang_timeout_s = 5
    launcher = launched(tmp_path, "run", ["--hang-timeout-s", str(hang_timeout_s)])
    try:
        wait_for_records(launcher, tmp_path / "run.jsonl", 3)
        ranks = children(launcher.pid)
        assert {launcher.pid, *ranks.values()} <= set(left_behind(launcher.mark))
        victim = int(np.random.default_rng().integers(0, 2))
        stopped = time.monotonic()
        os.kill(ranks[victim], signal.SIGSTOP)
        _, err = launcher.communicate(timeout=120)
        took = time.monotonic() - stopped
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGKILL, err[-4000:]
    cause = rf"rank {victim} \(pid {ranks[victim]}\) stopped answering: no heartbeat for [\d.]+ s"
    assert re.search(
        rf"^jaxdp launch: {cause} \(stopped by a signal\); stopping the other 1 rank\(s\) "
        r"\(SIGKILL\)$",
        err,
        re.M,
    ), err[-4000:]
    assert re.search(
        rf"\njaxdp launch: failed: rank {victim} stopped answering: no heartbeat for [\d.]+ s "
        r"\(stopped by a signal\)\n\Z",
        err,
    ), err[-4000:]
    # Its last beat came up to a second before the stop. The upper bound is far from
    # JAX's own heartbeat (60 s), the other way this run could end.
    assert hang_timeout_s - 1.5 <= took < hang_timeout_s + 20, took
    assert left_behind(launcher.mark) == []
    assert len(assert_ports_free(tmp_path, "run")) == 2

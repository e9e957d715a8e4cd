"""Several processes, the library's side: jaxdp.initialize, the per-process share of a
batch, and what happens when a peer fails without a launcher. Multi-process runs are
subprocesses with their own device counts, never this process's 8."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import pytest
from helpers import reserved_port

import jaxdp

ENV_NAMES = (
    "JAXDP_COORDINATOR_ADDRESS",
    "JAXDP_NUM_PROCESSES",
    "JAXDP_PROCESS_ID",
    "JAXDP_LOCAL_DEVICE_IDS",
    "JAXDP_CPU_DEVICES",
    "JAXDP_TIMEOUT_S",
    "JAXDP_HEARTBEAT_TIMEOUT_S",
)
# JAX's start-up and heartbeat timeouts in the failure tests.
TIMEOUT_S, HEARTBEAT_S = 3, 5
# What each failure may take at most: the timeouts above, plus JAX's ~5 s between
# its deadline and ending the process, plus start-up on 2 busy cores (about 15 s
# in all when the machine is busy). Below the defaults a lost setting would fall
# back to (100 s to start), so far from both.
BOUND_S = 80


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_initialize_with_nothing_set_is_one_process(clean_env):
    mesh = jaxdp.initialize()
    assert mesh.devices.size == len(jax.devices()) == 8
    assert jax.process_count() == 1
    assert not jax.distributed.is_initialized()


@pytest.mark.parametrize(
    "kwargs,env,message",
    [
        (
            {"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 2},
            {},
            r"process_id=2 must be in \[0, num_processes - 1\] = \[0, 1\] \(num_processes=2\)",
        ),
        ({"num_processes": 0}, {}, r"num_processes=0 must be a positive integer"),
        (
            {},
            {"JAXDP_COORDINATOR_ADDRESS": "localhost", "JAXDP_NUM_PROCESSES": "2"},
            r"JAXDP_COORDINATOR_ADDRESS='localhost' must be host:port",
        ),
        ({}, {"JAXDP_PROCESS_ID": "one"}, r"JAXDP_PROCESS_ID='one' must be an integer"),
        ({"timeout_s": -1}, {}, r"timeout_s=-1 must be a positive integer"),
    ],
)
def test_initialize_names_the_bad_setting_and_where_it_came_from(clean_env, kwargs, env, message):
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        jaxdp.initialize(**kwargs)


@pytest.fixture
def port():
    """A free local port for the coordinator, held until the test ends (helpers.py)."""
    with reserved_port() as port:
        yield port


def test_a_process_whose_peer_never_starts_ends_with_a_clear_error(tmp_path, port):
    env = dict(
        os.environ,
        JAXDP_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAXDP_NUM_PROCESSES="2",
        JAXDP_PROCESS_ID="0",
        JAXDP_TIMEOUT_S=str(TIMEOUT_S),
        JAXDP_CPU_DEVICES="2",
    )
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", "import jaxdp; jaxdp.initialize(); print('started')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    took = time.monotonic() - start
    assert done.returncode != 0 and "started" not in done.stdout
    assert (
        f"jaxdp.initialize: process 0 of 2 waited {TIMEOUT_S} s (JAXDP_TIMEOUT_S='{TIMEOUT_S}') "
        "for all processes to connect to 127.0.0.1:"
    ) in done.stderr
    assert "a process never started" in done.stderr
    print(f"peer never started: ended after {took:.1f} s")


def test_without_a_launcher_a_dead_peer_ends_the_others_after_the_heartbeat_timeout(tmp_path, port):
    # As on several machines: nothing watches the processes but JAX's heartbeats.
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent("""
        import os, signal
        import jax, jax.numpy as jnp, numpy as np
        import jaxdp
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = jaxdp.initialize()
        total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), np.ones(2))
        for i in range(10**9):
            if i == 3 and jax.process_index() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            assert float(total(x)) == 4.0
        """)
    )
    env = dict(os.environ, JAXDP_COORDINATOR_ADDRESS=f"127.0.0.1:{port}")
    env.update(JAXDP_NUM_PROCESSES="2", JAXDP_CPU_DEVICES="2", JAXDP_TIMEOUT_S="60")
    env.update(JAXDP_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_S))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "JAXDP_PROCESS_ID": str(p)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in (0, 1)
    ]
    try:
        assert procs[1].wait(timeout=120) == -signal.SIGKILL
        start = time.monotonic()
        err = procs[0].communicate(timeout=BOUND_S)[1]
        took = time.monotonic() - start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert procs[0].returncode != 0
    assert "stopped sending heartbeats" in err  # JAX's words for a dead peer
    # About 6 to 10 s; jaxdp's default heartbeat timeout, were the setting lost, is 60 s.
    assert took < 40
    print(f"peer killed, no launcher: the survivor ended {took:.1f} s later")


def test_import_and_initialize_leave_the_process_as_they_found_it(port):
    """A library never changes its user's process (issue 31, item 4): after ``import jaxdp``
    (and its tools) and ``jaxdp.initialize()`` joining two real processes over gloo, the
    excepthook, the SIGTERM and SIGINT handlers and file descriptors 1 and 2 are the ones
    the process had. jaxdp 0.3 replaced the excepthook and, on CPU, fd 1 here."""
    code = textwrap.dedent("""
        import json, os, signal, sys
        def seen():
            return {
                "excepthook": id(sys.excepthook),
                "stdout": id(sys.stdout),
                "SIGTERM": repr(signal.getsignal(signal.SIGTERM)),
                "SIGINT": repr(signal.getsignal(signal.SIGINT)),
                **{f"fd {fd}": [os.fstat(fd).st_dev, os.fstat(fd).st_ino] for fd in (1, 2)},
            }
        before = seen()
        import jaxdp, jaxdp.checkpoint, jaxdp.data, jaxdp.testing
        imported = seen()
        mesh = jaxdp.initialize()
        import jax
        assert jax.process_count() == 2 and mesh.devices.size == 4
        sys.stderr.write(json.dumps([before, imported, seen()]) + "\\n")
    """)
    env = dict(os.environ, JAXDP_COORDINATOR_ADDRESS=f"127.0.0.1:{port}")
    env.update(JAXDP_NUM_PROCESSES="2", JAXDP_CPU_DEVICES="2", JAXDP_TIMEOUT_S="60")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**env, "JAXDP_PROCESS_ID": str(p)},
            stdout=subprocess.PIPE,  # a pipe, as a launcher gives: its own inode
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in (0, 1)
    ]
    try:
        done = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (_, err) in zip(procs, done, strict=True):
        assert proc.returncode == 0, err[-3000:]
        before, imported, initialized = json.loads(err.strip().splitlines()[-1])
        assert imported == before
        assert initialized == before


# ---- the process's share of a batch ------------------------------------------------------


def test_one_process_shares_everything():
    sizes = jaxdp.batch_sizes(num_devices=4, accum_steps=2, micro_batch_size=3)
    share = jaxdp.process_share(jaxdp.data_mesh(4), sizes)
    assert share == jaxdp.ProcessShare(0, 1, range(4), slice(0, 24), slice(0, 12), sizes)


def test_share_needs_the_mesh_size():
    sizes = jaxdp.batch_sizes(num_devices=2, accum_steps=1, micro_batch_size=3)
    with pytest.raises(ValueError, match=r"sizes.num_devices=2 must be the mesh's 4 devices"):
        jaxdp.process_share(jaxdp.data_mesh(4), sizes)

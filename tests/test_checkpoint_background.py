"""Saves that do not stall training (issue 43, item 3): ``Checkpoints(background=True)``
returns once the state is on the host, and a process killed at any moment of the
background write leaves the newest complete checkpoint, restored bitwise.

Run as a script, this file is the process that is killed: ``python THIS POINT DIR``
trains two steps, saves after each in the background, holds the second save at
``POINT`` and says so on stdout; the test then kills it with SIGKILL. ``python THIS
ENDING DIR`` is a script that ends (``ENDING``: at its last line, by ``sys.exit(0)``,
by an exception) while its background save is still taking the SHA-256s.
"""

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import reserved_port

import jaxdp
from jaxdp.checkpoint import CheckpointError, Checkpoints

WIDTH = 256  # a 256 x 256 float64 kernel: 0.5 MB, Adam's moments twice that


def make_step():
    return jaxdp.make_train_step(
        lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2),
        optax.adam(1e-2),
        mesh=jaxdp.data_mesh(1),
    )


def init(step):
    return step.init({"w": jnp.zeros((WIDTH, WIDTH), jnp.float64)})


def batch(i):
    rng = np.random.default_rng(i)
    return rng.normal(size=(8, WIDTH)), rng.normal(size=(8, WIDTH))


def say(line: str) -> None:
    """Writes ``line`` and its newline in one write: the save's thread and the training
    one each say a line, and print writes a text and its newline apart, which let the two
    lines interleave ("held at hashingtrained step 3", then an empty line: a CI run)."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


def hold(point: str) -> None:
    """Says the save reached ``point`` and waits there to be killed."""
    say(f"held at {point}")
    time.sleep(600)


def child(point: str, directory: pathlib.Path) -> None:
    """Saves steps 1 and 2 in the background, holding the second at ``point``; trains a
    third step meanwhile, which shows the save returned before it was written."""
    from orbax.checkpoint._src.path import atomicity

    from jaxdp.checkpoint import _checkpoints

    step, checkpoints = make_step(), Checkpoints(directory, background=True)
    state = init(step)
    for i in (1, 2):
        state, _ = step(state, batch(i))
        np.save(directory.parent / f"step{i}.npy", np.asarray(state.params["w"]))
        if i == 2:
            checkpoints.wait_until_finished()  # the first save is whole
            if point == "hashing":
                _checkpoints.array_sha256 = lambda *x: hold("hashing")
            elif point == "rename":

                async def finalize(self):
                    hold(point)

                atomicity.AtomicRenameTemporaryPath.finalize = finalize
            else:
                _checkpoints.Checkpoints._read_on_host = lambda *args: hold(point)
        checkpoints.save(state)
    state, _ = step(state, batch(3))  # while the second save is held
    say(f"trained step {int(state.step)}")
    checkpoints.wait_until_finished()


# The newest complete checkpoint when the save of step 2 is killed at each point: held
# while hashing (step 2 is not written yet), before orbax's rename (written, not yet
# under its number) and while reading it back (renamed: complete, not yet verified here;
# restore checks its SHA-256s).
KILLED_AT = {"hashing": 1, "rename": 1, "verifying": 2}


@pytest.mark.parametrize("point", sorted(KILLED_AT))
def test_a_kill_during_a_background_save_leaves_the_newest_complete_checkpoint(tmp_path, point):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    process = subprocess.Popen(
        [sys.executable, __file__, point, str(directory)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    stopper = threading.Timer(300, process.kill)  # never a hung test
    stopper.start()
    try:
        lines = []
        while len(lines) < 2:  # "held at POINT" and "trained step 3", in either order
            line = process.stdout.readline()
            assert line, f"the process ended first: {lines}"
            lines.append(line.strip())
        process.send_signal(signal.SIGKILL)
        process.wait()
    finally:
        stopper.cancel()
        process.kill()
    # The save of step 2 never ended, and the step after it ran: save(state) had returned.
    assert sorted(lines) == [f"held at {point}", "trained step 3"]

    step, checkpoints = make_step(), Checkpoints(directory)
    newest = KILLED_AT[point]
    assert checkpoints.steps == list(range(1, newest + 1))
    restored = checkpoints.restore(init(step))
    assert int(restored.state.step) == newest
    np.testing.assert_array_equal(
        restored.state.params["w"], np.load(tmp_path / f"step{newest}.npy")
    )
    # Opening and restoring remove nothing; the next save, with no save running (the dead
    # one's lock went with it), removes what the killed save left.
    left = [p.name for p in directory.iterdir() if not p.name.isdigit()]
    assert sorted(left) == (["2.orbax-checkpoint-tmp", "jaxdp.saving"] if point == "rename" else [])
    state, _ = step(restored.state, batch(newest + 1))
    checkpoints.save(state)
    assert sorted(p.name for p in directory.iterdir()) == [str(n) for n in range(1, newest + 2)]


def ending(how: str, directory: pathlib.Path) -> None:
    """Saves step 1 in the background and ends ``how`` while the save is still hashing
    (each SHA-256 is 0.2 s late); the saved kernel goes to ``step1.npy`` first."""
    from jaxdp.checkpoint import _checkpoints

    step = make_step()
    state, _ = step(init(step), batch(1))
    np.save(directory.parent / "step1.npy", np.asarray(state.params["w"]))
    sha256 = _checkpoints.array_sha256
    _checkpoints.array_sha256 = lambda *x: (time.sleep(0.2), sha256(*x))[1]
    Checkpoints(directory, background=True).save(state)
    if how == "exit":
        sys.exit(0)
    if how == "raise":
        raise RuntimeError("the script fails after its save")


ENDINGS = {"end": 0, "exit": 0, "raise": 1}  # how the script ends: its exit status


@pytest.mark.parametrize("how", sorted(ENDINGS))
def test_a_script_that_ends_during_a_background_save_leaves_it_complete(tmp_path, how):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    ended = subprocess.run(
        [sys.executable, __file__, how, str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert ended.returncode == ENDINGS[how], ended.stderr
    assert "background save" not in ended.stderr  # neither failed nor abandoned
    assert sorted(p.name for p in directory.iterdir()) == ["1"]  # no temporary directory
    restored = Checkpoints(directory).restore(init(make_step()))  # its SHA-256s checked
    np.testing.assert_array_equal(restored.state.params["w"], np.load(tmp_path / "step1.npy"))


def test_a_background_save_s_failure_is_raised_at_the_next_call_and_keeps_the_older(
    tmp_path, monkeypatch, capfd
):
    step = make_step()
    checkpoints = Checkpoints(tmp_path, background=True, keep=1)
    state, _ = step(init(step), batch(1))
    checkpoints.save(state)
    checkpoints.wait_until_finished()
    monkeypatch.setattr(Checkpoints, "_read_on_host", lambda *args: 1 / 0)
    state, _ = step(state, batch(2))
    checkpoints.save(state)  # returns; the read-back fails in the background
    with pytest.raises(CheckpointError, match=r"/2 does not read back intact \(ZeroDivision"):
        checkpoints.wait_until_finished()
    assert "the background save of" in capfd.readouterr().err
    checkpoints.wait_until_finished()  # raised once
    assert checkpoints.steps == [1, 2]  # 1 is kept: 2 was never verified


def test_a_background_save_restores_bitwise_and_refuses_a_bad_flag(tmp_path):
    with pytest.raises(TypeError, match="background=1 must be True or False"):
        Checkpoints(tmp_path, background=1)
    step = make_step()
    checkpoints = Checkpoints(tmp_path, background=True)
    state, _ = step(init(step), batch(1))
    saved = np.array(state.params["w"])
    assert checkpoints.save(state) == tmp_path / "1"
    state, _ = step(state, batch(2))  # donates the saved state's buffers
    assert checkpoints.steps == [1]  # waits for the save
    restored = checkpoints.restore(init(step))
    np.testing.assert_array_equal(restored.state.params["w"], saved)


def test_an_opening_or_a_save_during_a_save_leaves_it_to_finish(tmp_path, monkeypatch):
    """A reader opening the directory and a second writer saving there while step 2 is
    written (held before orbax's rename, its temporary directory complete)."""
    from orbax.checkpoint._src.path import atomicity

    rename, reached, go = (
        atomicity.AtomicRenameTemporaryPath.finalize,
        threading.Event(),
        threading.Event(),
    )

    async def finalize(self):
        if self.get().name.startswith("2."):
            reached.set()
            go.wait(60)
        await rename(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)
    step = make_step()
    writer = Checkpoints(tmp_path, background=True)
    state, _ = step(init(step), batch(1))
    writer.save(state)
    state, _ = step(state, batch(2))
    writer.save(state)
    assert reached.wait(60)
    assert Checkpoints(tmp_path).steps == [1]  # a reader: opens, lists
    other, _ = step(state, batch(3))
    Checkpoints(tmp_path).save(other)  # another writer's save while step 2's is unfinished
    go.set()
    writer.wait_until_finished()  # step 2's save ends well
    assert Checkpoints(tmp_path).steps == [1, 2, 3]
    restored = Checkpoints(tmp_path).restore(init(step))  # 3, then 2 once 3 is set aside
    np.testing.assert_array_equal(restored.state.params["w"], other.params["w"])
    (tmp_path / "3").rename(tmp_path / "3.moved")
    restored = Checkpoints(tmp_path).restore(init(step))
    np.testing.assert_array_equal(restored.state.params["w"], state.params["w"])


def test_two_openings_over_a_leftover_both_save_and_the_leftover_goes(tmp_path):
    step = make_step()
    state, _ = step(init(step), batch(1))
    leftover = tmp_path / "5.orbax-checkpoint-tmp"  # a save that died before its rename
    (leftover / "replicated").mkdir(parents=True)
    for i in range(1000):  # orbax's clean-up on opening took long enough for two to meet
        (leftover / "replicated" / str(i)).write_bytes(b"x")
    first, second = Checkpoints(tmp_path), Checkpoints(tmp_path)
    first.save(state)
    state, _ = step(state, batch(2))
    second.save(state)
    assert first.steps == second.steps == [1, 2]
    assert not leftover.exists()


def blocks(tree):
    """Every leaf's blocks this process holds, in host memory: a split leaf compares
    bitwise by its blocks."""
    return jax.tree.map(lambda x: [np.array(s.data) for s in x.addressable_shards], tree)


@pytest.mark.devices(2, processes=2)
def test_background_saves_on_two_processes_restore_bitwise_split_leaves_and_all(
    shared_tmp_path,
):
    """2 processes x 2 devices at ZeRO stage 1 (Adam's moments split over the 4 devices,
    each process writing its blocks): two background saves, a step trained beside each,
    the older pruned behind the newer, which restores bitwise on every process."""
    mesh = jaxdp.initialize()
    step = jaxdp.make_train_step(
        lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2),
        optax.adam(1e-2),
        mesh=mesh,
        parallel=jaxdp.Parallel(zero_stage=1),
    )
    checkpoints = Checkpoints(shared_tmp_path / "ckpt", background=True, keep=1)
    state = step.init({"w": jnp.zeros((8, 4), jnp.float64)})
    rng = np.random.default_rng(jax.process_index())
    for _ in range(2):
        state, _ = step(state, (rng.normal(size=(4, 8)), rng.normal(size=(4, 4))))
        checkpoints.save(state)
        saved = blocks(state)
    state, _ = step(state, (rng.normal(size=(4, 8)), rng.normal(size=(4, 4))))  # beside it
    assert checkpoints.steps == [2]
    mu = state.opt_state[0].mu["w"]
    assert not mu.is_fully_addressable  # the leaf each process wrote its part of
    restored = checkpoints.restore(step.init({"w": jnp.zeros((8, 4), jnp.float64)}))
    assert_trees_equal(blocks(restored.state.params), saved.params)
    assert_trees_equal(blocks(restored.state.opt_state), saved.opt_state)


def assert_trees_equal(actual, expected):
    jax.tree.map(np.testing.assert_array_equal, actual, expected)


def hold_at(point: str) -> None:
    """Has this process's next background save hold at ``point`` (:data:`KILLED_ON`)."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.path import atomicity

    from jaxdp.checkpoint import _checkpoints

    save = ocp.CompositeCheckpointHandler.save

    def written(self, *args, **kwargs):
        save(self, *args, **kwargs)
        hold("writing")

    async def finalize(self):
        hold("rename")

    hooks = {
        "hashing": (_checkpoints, "array_sha256", lambda *x: hold("hashing")),
        "writing": (ocp.CompositeCheckpointHandler, "save", written),
        "rename": (atomicity.AtomicRenameTemporaryPath, "finalize", finalize),
        "verifying": (Checkpoints, "_read_on_host", lambda *args: hold("verifying")),
        "pruning": (Checkpoints, "_prune", lambda *args, **kwargs: hold("pruning")),
    }
    setattr(*hooks[point])


def distributed_child(point: str, process_id: int, port: int, directory: pathlib.Path) -> None:
    """One of two processes (a CPU device each, ZeRO stage 1: Adam's moments split over
    both) saving steps 1 and 2 in the background, ``keep=1``; the process of
    :data:`KILLED_ON` holds the second save at ``point`` and says so."""
    mesh = jaxdp.initialize(f"127.0.0.1:{port}", 2, process_id, cpu_devices=1, timeout_s=60)
    step = jaxdp.make_train_step(
        lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2),
        optax.adam(1e-2),
        mesh=mesh,
        parallel=jaxdp.Parallel(zero_stage=1),
    )
    checkpoints = Checkpoints(directory, background=True, keep=1)
    state = step.init({"w": jnp.zeros((8, 4), jnp.float64)})
    for i in (1, 2):
        x, y = batch(i)
        state, _ = step(state, (x[:, :8], y[:, :4]))
        (mu,) = state.opt_state[0].mu["w"].addressable_shards  # this process's rows
        np.save(directory.parent / f"mu{i}-{process_id}.npy", np.asarray(mu.data))
        if process_id == 0:
            np.save(directory.parent / f"step{i}.npy", np.asarray(state.params["w"]))
        if i == 2:
            checkpoints.wait_until_finished()  # the first save is whole
        if i == 2 and process_id == KILLED_ON[point]:
            hold_at(point)
        checkpoints.save(state)
    x, y = batch(3)
    state, _ = step(state, (x[:, :8], y[:, :4]))  # while the second save is held
    say(f"trained step {int(state.step)}")
    checkpoints.wait_until_finished()


# Two processes, one killed while the save of step 2 is at each point (the other after
# it): held while hashing (process 0: it alone takes SHA-256s; nothing written), after
# writing its blocks (process 1, before orbax's barrier), before the rename (process 0's,
# after every process wrote), while reading back (renamed: complete) and while pruning
# (read back everywhere, 1 not yet deleted).
KILLED_ON = {"hashing": 0, "writing": 1, "rename": 0, "verifying": 1, "pruning": 0}
KILLED_STEPS = {
    "hashing": [1],
    "writing": [1],
    "rename": [1],
    "verifying": [1, 2],
    "pruning": [1, 2],
}


def said(process: subprocess.Popen) -> str:
    """The process's next line on stdout but gloo's own."""
    while True:
        line = process.stdout.readline()
        assert line, "the process ended first"
        if not line.startswith("[Gloo]"):
            return line.strip()


@pytest.mark.parametrize("point", sorted(KILLED_ON))
def test_a_kill_of_one_process_during_a_background_save_leaves_the_newest_complete(tmp_path, point):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with reserved_port() as port:
        processes = [
            subprocess.Popen(
                [sys.executable, __file__, point, str(directory), str(i), str(port)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
            for i in (0, 1)
        ]
        stopper = threading.Timer(300, lambda: [p.kill() for p in processes])  # never hung
        stopper.start()
        try:
            killed, other = processes[KILLED_ON[point]], processes[1 - KILLED_ON[point]]
            lines = []
            lines = [said(killed), said(killed)]  # "held at POINT", "trained step 3": any order
            assert said(other) == "trained step 3"
            killed.send_signal(signal.SIGKILL)
            killed.wait()
            time.sleep(0.5)  # the other process goes on as far as it can alone
            other.kill()  # as a launcher ends the rest of a job one process of left
            other.wait()
        finally:
            stopper.cancel()
            for p in processes:
                p.kill()
    assert sorted(lines) == [f"held at {point}", "trained step 3"]
    assert Checkpoints(directory).steps == KILLED_STEPS[point]
    step = jaxdp.make_train_step(
        lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2),
        optax.adam(1e-2),
        mesh=jaxdp.data_mesh(2),
        parallel=jaxdp.Parallel(zero_stage=1),
    )
    restored = Checkpoints(directory).restore(step.init({"w": jnp.zeros((8, 4), jnp.float64)}))
    newest = KILLED_STEPS[point][-1]
    assert int(restored.state.step) == newest
    np.testing.assert_array_equal(
        restored.state.params["w"], np.load(tmp_path / f"step{newest}.npy")
    )
    mu = [np.load(tmp_path / f"mu{newest}-{i}.npy") for i in (0, 1)]
    np.testing.assert_array_equal(restored.state.opt_state[0].mu["w"], np.concatenate(mu))


if __name__ == "__main__":
    jax.config.update("jax_enable_x64", True)
    if len(sys.argv) == 5:  # POINT DIR PROCESS_ID PORT: jaxdp.initialize sets the devices
        distributed_child(
            sys.argv[1], int(sys.argv[3]), int(sys.argv[4]), pathlib.Path(sys.argv[2])
        )
    else:
        jaxdp.emulate_cpu_devices(1)
        if sys.argv[1] in ENDINGS:
            ending(sys.argv[1], pathlib.Path(sys.argv[2]))
        else:
            child(sys.argv[1], pathlib.Path(sys.argv[2]))

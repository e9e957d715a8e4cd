"""Preemption in a loop of one's own (issue 43, item 2): ``Checkpoints.preempted`` on JAX's
preemption sync point. Two real processes joined by ``jax.distributed``; SIGTERM to one
stops both at the same optimizer step with a checkpoint there, and a rerun of the same
command, keyed on the checkpoints present, ends bitwise where an uninterrupted run ends.

Run as a script, this file is one process of the run: ``python THIS ID PORT DIR``.
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
from helpers import reserved_port

import jaxdp
import jaxdp.checkpoint

STEPS = 40  # optimizer steps of the whole run: 4 epochs of 10


def run(process_id: int, port: int, directory: pathlib.Path) -> None:
    """The team's loop: resume if a checkpoint is there, stop when preempted."""
    import jaxdp.checkpoint
    import jaxdp.data

    mesh = jaxdp.initialize(f"127.0.0.1:{port}", 2, process_id, cpu_devices=1, timeout_s=60)
    x = np.random.default_rng(0).normal(size=(160, 3))
    source = {"x": x, "y": x @ np.array([1.0, -2.0, 0.5])}
    sizes = jaxdp.batch_sizes(num_devices=2, accum_steps=2, micro_batch_size=4)
    step = jaxdp.make_train_step(
        lambda p, b: jnp.mean((b["x"] @ p - b["y"]) ** 2),
        optax.adam(0.05),
        mesh=mesh,
        accum_steps=2,
    )
    checkpoints = jaxdp.checkpoint.Checkpoints(directory)
    with jaxdp.data.Loader(source, sizes, mesh=mesh, epochs=4, seed=0) as loader:
        state = step.init(np.zeros(3))
        if checkpoints.steps:  # keyed on the checkpoints there, not on a restart count
            state = checkpoints.restore(state, data=loader).state
        for batch in loader:
            state, _ = step(state, batch)
            print(f"step {int(state.step)}", flush=True)
            if checkpoints.preempted(state, data=loader):
                print(f"stopped at step {int(state.step)}", flush=True)
                return
            time.sleep(0.05)  # a step of real work: the signal comes mid-run
    if process_id == 0:
        np.save(directory.parent / f"final-{directory.name}.npy", np.asarray(state.params))
    print("done", flush=True)


def start(port: int, directory: pathlib.Path) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return [
        subprocess.Popen(
            [sys.executable, __file__, str(i), str(port), str(directory)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for i in (0, 1)
    ]


def finish(processes: list[subprocess.Popen]) -> list[list[str]]:
    """Every process's lines, once all ended with status 0."""
    outputs = []
    for p in processes:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out
        outputs.append(out.split("\n"))
    return outputs


def test_sigterm_to_one_process_stops_both_at_one_step_and_a_rerun_continues_bitwise(
    tmp_path,
):
    preempted, whole = tmp_path / "preempted", tmp_path / "whole"
    with reserved_port() as port:
        processes = start(port, preempted)
        stopper = threading.Timer(240, lambda: [p.kill() for p in processes])
        stopper.start()
        try:
            seen = []
            while "step 3" not in seen:  # training, then the scheduler's notice
                line = processes[1].stdout.readline()
                assert line, f"process 1 ended first: {seen}"
                seen.append(line.strip())
            processes[1].send_signal(signal.SIGTERM)
            outputs = finish(processes)
        finally:
            stopper.cancel()
    outputs[1] = seen + outputs[1]
    stops = [[x for x in out if x.startswith("stopped")] for out in outputs]
    assert stops[0] == stops[1] and len(stops[0]) == 1, stops
    stopped = int(stops[0][0].split()[-1])
    assert 3 <= stopped < STEPS
    assert jaxdp.checkpoint.Checkpoints(preempted).steps == [stopped]

    runs = {}
    for directory in (preempted, whole):  # the requeued job, then a run never stopped
        with reserved_port() as port:
            runs[directory] = finish(start(port, directory))
        assert all("done" in out for out in runs[directory])
    resumed = [x for x in runs[preempted][0] if x.startswith("step")]
    assert resumed[0] == f"step {stopped + 1}" and resumed[-1] == f"step {STEPS}"
    np.testing.assert_array_equal(
        np.load(tmp_path / "final-preempted.npy"), np.load(tmp_path / "final-whole.npy")
    )


# mpirun forwards SIGTERM to every rank and sends SIGKILL once its grace is over (Open MPI's
# odls_base_sigkill_timeout, 1 s by default; docs/scaling-out.md): a grace the save fits in.
GRACE_S = 60


def test_sigterm_to_every_rank_then_sigkill_after_a_grace_leaves_the_stop_s_checkpoint(
    tmp_path,
):
    """mpirun's preemption emulated: SIGTERM to both processes, SIGKILL to whatever still
    runs after the grace. Both stop at one step with its checkpoint written, and end by
    themselves (status 0) before the SIGKILL."""
    directory = tmp_path / "preempted"
    killer = threading.Timer(GRACE_S, lambda: [p.kill() for p in processes])
    with reserved_port() as port:
        processes = start(port, directory)
        try:
            seen = []
            while "step 3" not in seen:
                line = processes[1].stdout.readline()
                assert line, f"process 1 ended first: {seen}"
                seen.append(line.strip())
            for p in processes:
                p.send_signal(signal.SIGTERM)
            killer.start()
            sent, after = time.monotonic(), []
            while not after or not after[-1].startswith("stopped"):  # saved, written
                after.append(processes[1].stdout.readline().strip())
                assert after[-1], f"process 1 ended first: {after}"
            saved = time.monotonic() - sent
            outputs = finish(processes)  # status 0: neither was killed
            ended = time.monotonic() - sent
            outputs[1] = after + outputs[1]
        finally:
            killer.cancel()
    stops = [[x for x in out if x.startswith("stopped")] for out in outputs]
    assert stops[0] == stops[1] and len(stops[0]) == 1, stops
    stopped = int(stops[0][0].split()[-1])
    assert jaxdp.checkpoint.Checkpoints(directory).steps == [stopped]
    assert jaxdp.checkpoint.Checkpoints(directory).metadata().step == stopped
    print(  # what docs/scaling-out.md quotes: how much of a grace the stop used
        f"SIGTERM after step {seen[-1].split()[-1]} or later; stopped at step {stopped}; "
        f"{saved:.1f} s after the SIGTERM, its checkpoint written; both ended after {ended:.1f} s"
    )


if __name__ == "__main__":
    jax.config.update("jax_enable_x64", True)
    run(int(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3]))

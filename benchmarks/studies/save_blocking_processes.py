"""How long a background checkpoint save holds a loop of several processes, beside orbax's.

Run from the repository root (a few minutes on 2 cores)::

    # under jaxdp's launcher, 2 or 4 processes of one CPU device each:
    bin/jaxdp launch --nprocs 2 --devices-per-process 1 -- \\
        benchmarks/studies/save_blocking_processes.py --mb 300 --rounds 5
    # under a launcher of one's own (this script starts the processes, each calling
    # jax.distributed.initialize itself):
    .venv/bin/python benchmarks/studies/save_blocking_processes.py --processes 2 --mb 300

The state is :mod:`save_blocking`'s (AdamW over one float32 matrix, ``--mb`` MB saved),
replicated over the processes' devices. Each round saves it once with each kind, in an
order rotated from round to round, to a fresh directory, and times until ``save``
returns on every process (the slowest: the next step's collective waits for it):

- ``jaxdp background``: ``Checkpoints(background=True).save(state)``;
- ``orbax async``: an orbax ``CheckpointManager`` with asynchronous checkpointing;
- ``jaxdp sync``: ``Checkpoints().save(state)`` (SHA-256s, write, read-back).

Then 4 steps right after a background save returned (its thread hashing, writing and
reading back), against 4 steps with no save, in alternating order, for jaxdp's and for
orbax's: what the save costs the steps beside it. Ratios are medians of per-round
ratios. Process 0 prints; BENCHMARKS.md's section 8 quotes it.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from save_blocking import orbax_tree, step_and_state

import jaxdp
from jaxdp.checkpoint import Checkpoints

KINDS = ("jaxdp background", "orbax async", "jaxdp sync")


class Saver:
    """One kind of save into a fresh directory (process 0's, broadcast by name)."""

    def __init__(self, kind: str, round_: int):
        self.kind = kind
        self.directory = os.path.join(os.environ["SAVES"], f"{kind.replace(' ', '-')}-{round_}")
        if kind.startswith("jaxdp"):
            self.checkpoints = Checkpoints(self.directory, background=kind == "jaxdp background")
        else:
            options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
            self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, state) -> None:
        if self.kind.startswith("jaxdp"):
            self.checkpoints.save(state)
        else:
            args = ocp.args.Composite(state=ocp.args.StandardSave(orbax_tree(state)))
            self.manager.save(int(state.step), args=args)

    def finish(self) -> None:
        if self.kind.startswith("jaxdp"):
            self.checkpoints.wait_until_finished()
        else:
            self.manager.wait_until_finished()
            self.manager.close()
        multihost_utils.sync_global_devices(f"finished {self.directory}")
        if jax.process_index() == 0:
            shutil.rmtree(self.directory, ignore_errors=True)


def slowest(seconds: float) -> float:
    """The longest of every process's ``seconds``."""
    return float(np.max(multihost_utils.process_allgather(np.float64(seconds))))


def timed_save(kind: str, round_: int, state) -> float:
    saver = Saver(kind, round_)
    multihost_utils.sync_global_devices(f"start {saver.directory}")
    start = time.perf_counter()
    saver.save(state)
    seconds = time.perf_counter() - start
    saver.finish()
    return slowest(seconds)


def steps_timed(kind, round_, step, state, batch, *, beside_a_save: bool, steps: int = 4):
    saver = Saver(kind, round_)
    multihost_utils.sync_global_devices(f"steps {saver.directory}")
    if beside_a_save:
        saver.save(state)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - start) / steps
    saver.finish()
    return slowest(seconds), state


def measure(mb: float, rounds: int) -> None:
    mesh = jaxdp.initialize()  # under jaxdp launch; or the runtime is up already
    step, state, batch = step_and_state(mb, mesh=mesh)
    size = sum(x.nbytes for x in jax.tree.leaves(orbax_tree(state)))
    say = print if jax.process_index() == 0 else (lambda *a: None)
    say(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    say(f"versions: jax {jax.__version__}, orbax-checkpoint {ocp.__version__}")
    say(f"processes: {jax.process_count()} x {jax.local_device_count()} device(s)")
    say(f"state: {size / 1e6:.0f} MB saved (AdamW over one float32 matrix, replicated)")
    for kind in KINDS:  # warm-up: compiles, imports, the page cache
        timed_save(kind, -1, state)
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for r in range(rounds):
        for kind in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
            samples[kind].append(timed_save(kind, r, state))
    for kind in KINDS:
        s = samples[kind]
        say(f"{kind:>17}: median {statistics.median(s):.3f} s (range {min(s):.3f} to {max(s):.3f})")
    for kind in ("jaxdp background", "jaxdp sync"):
        ratio = [a / b for a, b in zip(samples[kind], samples["orbax async"], strict=True)]
        say(
            f"{kind} / orbax async, held: median {statistics.median(ratio):.2f}x "
            f"(per-round {min(ratio):.2f} to {max(ratio):.2f})"
        )
    for kind in ("jaxdp background", "orbax async"):
        beside = []
        for r in range(rounds):
            times = {}
            for during in (r % 2 == 0, r % 2 == 1):
                times[during], state = steps_timed(
                    kind, 100 + r, step, state, batch, beside_a_save=during
                )
            beside.append(times[True] / times[False])
        say(
            f"{kind}: a step beside its save / alone: median {statistics.median(beside):.2f}x "
            f"(per-round {min(beside):.2f} to {max(beside):.2f}; alone {times[False]:.3f} s)"
        )


def launch(processes: int, argv: list[str]) -> int:
    """A launcher of one's own: ``processes`` copies of this script, each calling
    ``jax.distributed.initialize`` itself (not through jaxdp), on one CPU device."""
    port = 20000 + os.getpid() % 20000
    children = []
    for i in range(processes):
        env = {**os.environ, "FOREIGN": json.dumps([f"127.0.0.1:{port}", processes, i])}
        children.append(subprocess.Popen([sys.executable, __file__, *argv], env=env))
    return max(c.wait() for c in children)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=300.0, help="size of the saved arrays, MB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, help="start this many processes itself")
    args = parser.parse_args()
    if args.processes and "FOREIGN" not in os.environ:
        with tempfile.TemporaryDirectory(prefix="jaxdp-saves-") as saves:
            os.environ["SAVES"] = saves
            sys.exit(launch(args.processes, ["--mb", str(args.mb), "--rounds", str(args.rounds)]))
    if "FOREIGN" in os.environ:
        address, count, index = json.loads(os.environ["FOREIGN"])
        jax.config.update("jax_num_cpu_devices", 1)
        jax.distributed.initialize(address, count, index)
    if "SAVES" not in os.environ:  # under jaxdp launch: one directory every process names
        os.environ["SAVES"] = os.path.join(tempfile.gettempdir(), f"jaxdp-saves-{os.getppid()}")
    measure(args.mb, args.rounds)
    if jax.process_index() == 0:
        shutil.rmtree(os.environ["SAVES"], ignore_errors=True)


if __name__ == "__main__":
    main()

"""How long a checkpoint save holds the training loop: jaxdp's saves beside orbax's.

Run from the repository root (about two minutes on 2 cores)::

    .venv/bin/python benchmarks/studies/save_blocking.py              # 300 MB, 7 rounds
    .venv/bin/python benchmarks/studies/save_blocking.py --mb 600 --rounds 9

One process, one CPU device, float32. The state is a jaxdp ``TrainState`` of AdamW over
one parameter matrix sized so that the saved arrays (parameters and the two moments)
weigh ``--mb`` MB. Each round times, in an order rotated from round to round, the time
until each call returns:

- ``jaxdp background``: ``Checkpoints(background=True).save(state)`` (the state copied to
  host memory; SHA-256s, write, read-back and pruning happen in a thread, waited for
  afterwards, untimed);
- ``orbax async``: an orbax ``CheckpointManager`` with asynchronous checkpointing saving
  the same tree (``StandardSave`` of every array), waited for afterwards, untimed;
- ``jaxdp verify`` and ``jaxdp no verify``: ``Checkpoints(verify=...).save(state)``, the
  synchronous saves (SHA-256s, write, and with ``verify`` the read-back);
- ``orbax sync``: the same manager with asynchronous checkpointing off.

Then, per round, the time of 4 training steps of that state (AdamW over the matrix)
right after a background save returned, while its thread hashes, writes and reads back,
against 4 steps with no save, in alternating order: what the thread costs the loop
beyond ``save``'s own return (the steps also compute into fresh buffers: a state a host
view holds is not donated).

Each save goes to a fresh directory (removed after), the page cache warm from the rounds
before. The ratios are the medians of the per-round ratios (the load of other processes
moves both sides of a round alike). Prints the machine and every figure;
BENCHMARKS.md's "Checkpoint saves" quotes them.
"""

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import jaxdp
from jaxdp.checkpoint import Checkpoints


def step_and_state(megabytes: float, mesh=None):
    """The step and state timed (on one CPU device, or ``mesh``), and a batch."""
    rows = max(1, int(megabytes * 1e6 / 4 / 3 / 1024))  # params + 2 moments, float32
    step = jaxdp.make_train_step(
        lambda p, b: jnp.mean((b @ p["w"]) ** 2),
        optax.adamw(1e-3),
        mesh=jaxdp.data_mesh(1) if mesh is None else mesh,
    )
    batch = np.ones((8, rows), np.float32)
    state = step.init({"w": np.zeros((rows, 1024), np.float32)})
    state, _ = step(state, batch)
    jax.block_until_ready(state)
    return step, state, batch


def steps_timed(step, state, batch, *, beside_a_save: bool, steps: int = 4):
    """Seconds per step of ``steps`` steps, started right after a background save returned
    (its thread then hashes, writes and reads back while they run), or with no save."""
    directory = tempfile.mkdtemp(prefix="jaxdp-save-")
    try:
        checkpoints = Checkpoints(directory, background=True)
        if beside_a_save:
            checkpoints.save(state)
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        seconds = (time.perf_counter() - start) / steps
        checkpoints.wait_until_finished()
        return seconds, state
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def orbax_tree(state):  # what orbax saves of the state
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step}


def timed_save(kind: str, state) -> float:
    directory = tempfile.mkdtemp(prefix="jaxdp-save-")
    try:
        if kind.startswith("jaxdp"):
            checkpoints = Checkpoints(
                directory, verify=kind != "jaxdp no verify", background=kind == "jaxdp background"
            )
            start = time.perf_counter()
            checkpoints.save(state)
            seconds = time.perf_counter() - start
            checkpoints.wait_until_finished()
        else:
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=kind == "orbax async", max_to_keep=None
            )
            manager = ocp.CheckpointManager(directory, options=options)
            args = ocp.args.Composite(state=ocp.args.StandardSave(orbax_tree(state)))
            start = time.perf_counter()
            manager.save(1, args=args)
            seconds = time.perf_counter() - start
            manager.wait_until_finished()
            manager.close()
        return seconds
    finally:
        shutil.rmtree(directory, ignore_errors=True)


KINDS = ("jaxdp background", "orbax async", "jaxdp verify", "jaxdp no verify", "orbax sync")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=300.0, help="size of the saved arrays, MB")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    step, state, batch = step_and_state(args.mb)
    size = sum(x.nbytes for x in jax.tree.leaves(orbax_tree(state)))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"versions: jax {jax.__version__}, orbax-checkpoint {ocp.__version__}")
    print(f"state: {size / 1e6:.0f} MB saved (AdamW over one float32 matrix)")
    for kind in KINDS:  # warm-up: compiles, imports, the page cache
        timed_save(kind, state)
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for r in range(args.rounds):
        for kind in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
            samples[kind].append(timed_save(kind, state))
    for kind in KINDS:
        s = samples[kind]
        print(
            f"{kind:>17}: median {statistics.median(s):.3f} s (range {min(s):.3f} to {max(s):.3f})"
        )
    ratio = [
        a / b for a, b in zip(samples["jaxdp background"], samples["orbax async"], strict=True)
    ]
    print(
        f"jaxdp background / orbax async, blocking: median {statistics.median(ratio):.2f}x "
        f"(per-round range {min(ratio):.2f} to {max(ratio):.2f})"
    )
    for kind in ("jaxdp verify", "jaxdp no verify", "orbax sync"):
        ratio = [a / b for a, b in zip(samples[kind], samples["orbax async"], strict=True)]
        print(f"{kind} / orbax async: median {statistics.median(ratio):.1f}x")
    beside: list[float] = []
    for r in range(args.rounds):  # steps beside a background save against steps alone
        times = {}
        for during in (r % 2 == 0, r % 2 == 1):
            times[during], state = steps_timed(step, state, batch, beside_a_save=during)
        beside.append(times[True] / times[False])
    print(
        f"a step's time beside a background save / alone: median "
        f"{statistics.median(beside):.2f}x (per-round range {min(beside):.2f} to "
        f"{max(beside):.2f}; alone {times[False]:.3f} s a step)"
    )


if __name__ == "__main__":
    main()

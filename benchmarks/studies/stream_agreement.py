"""What a streamed source costs the loop on several processes: the per-step agreement.

Run from the repository root (under a minute on 2 cores)::

    .venv/bin/python benchmarks/studies/stream_agreement.py

Two processes of 2 CPU devices each (jax.distributed on 127.0.0.1, gloo), the same
records (16,384 rows of 64 float32 features) as array fields and as a grain
``IterDataset`` (each process its half, ``[p::2]``), through ``jaxdp.data.Loader`` into
a fused step of a 64x64 linear layer (global batch 256, accum_steps=2), the loss read
back every step (as a loop that logs it). Times per step over 30 steps after 3 of
warm-up, median of 5 rounds, in alternating order: the random-access loader (no
agreement: the schedule is known), as arrays and as a grain ``MapDataset`` of records;
the stream's (one small all-gather per step, in the loop, so that a shard that ends first
ends the epoch for every process), with grain's default read threads and without them
(``to_iter_dataset(grain.ReadOptions(num_threads=0))``: the loader reads ahead on its own
thread); and the agreement alone (the loader's all-gather, 200 calls). Prints process 0's
figures; BENCHMARKS.md section 6 and docs/data.md quote them.
"""

import os
import socket
import statistics
import subprocess
import sys
import time

ROWS, FEATURES, STEPS, WARM, ROUNDS = 16384, 64, 30, 3, 5


def child(process: int, port: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process)
    import grain
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils

    import jaxdp
    import jaxdp.data

    mesh = jaxdp.data_mesh(4)
    sizes = jaxdp.batch_sizes(num_devices=4, accum_steps=2, micro_batch_size=32)
    x = np.random.default_rng(0).normal(size=(ROWS, FEATURES)).astype(np.float32)
    step = jaxdp.make_train_step(
        lambda w, b: jnp.mean((b["x"] @ w) ** 2), optax.sgd(1e-3), mesh=mesh, accum_steps=2
    )

    def stream(options=None):
        records = [{"x": row} for row in x]
        return grain.MapDataset.source(records)[process::2].to_iter_dataset(options)

    def per_step(make) -> float:
        loader = jaxdp.data.Loader(make(), sizes, mesh=mesh, epochs=1, workers=1)
        state, times = step.init(np.zeros((FEATURES, FEATURES), np.float32)), []
        with loader:
            start = time.perf_counter()
            for i, batch in enumerate(loader):
                state, metrics = step(state, batch)
                float(metrics["loss"])
                if i >= WARM:
                    times.append(time.perf_counter() - start)
                start = time.perf_counter()
                if i == WARM + STEPS:
                    break
        return statistics.median(times)

    def everyone(have: bool) -> bool:  # the loader's agreement, as jaxdp.data spells it
        return bool(np.min(multihost_utils.process_allgather(np.array([have], np.int32))))

    def agreement() -> float:
        everyone(True)
        start = time.perf_counter()
        for _ in range(200):
            everyone(True)
        return (time.perf_counter() - start) / 200

    kinds = {
        "arrays (random access)": lambda: {"x": x},
        "grain MapDataset of records (random access)": lambda: grain.MapDataset.source(
            [{"x": row} for row in x]
        ),
        "grain IterDataset of records (stream)": stream,
        "the same, ReadOptions(num_threads=0) (stream)": lambda: stream(
            grain.ReadOptions(num_threads=0)
        ),
    }
    rounds = {name: [] for name in kinds}
    alone = []
    for r in range(ROUNDS):
        for name in list(kinds)[:: 1 if r % 2 == 0 else -1]:
            rounds[name].append(per_step(kinds[name]))
        alone.append(agreement())
    if process == 0:
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        for name, times in rounds.items():
            print(f"{name}: {1e3 * statistics.median(times):.2f} ms a step")
        print(f"the agreement alone: {1e6 * statistics.median(alone):.0f} us a call")


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen([sys.executable, __file__, "--child", str(p), str(port)]) for p in range(2)
    ]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()

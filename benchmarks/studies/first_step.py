"""Time to the first step through the Python API, with JAX's persistent compilation cache
cold and warm (issue 26, item 6; docs/api.md holds the figures).

Run from the repository root (about two minutes on 2 cores)::

    .venv/bin/python benchmarks/studies/first_step.py               # 3 rounds, the medians
    .venv/bin/python benchmarks/studies/first_step.py --rounds 5

Each measurement is a fresh process: build the benchmark MLP or character GPT
(benchmarks/harness/_common.py), ``make_train_step``, ``init`` and one fused step of 4
devices x 2 micro-batches, timed from before the model is built to the step's result on
the host (imports and JAX's start excluded). "cold": an empty cache directory (the
programs are compiled and written); "warm": the directory the cold run filled; "off":
no cache. The rounds alternate the three, so load moves them alike.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ONE = """
import json, sys, time
import jaxdp
jaxdp.emulate_cpu_devices(4)
import jax, optax
sys.path.insert(0, "benchmarks")
from harness._common import MODELS
if sys.argv[2]:
    jax.config.update("jax_compilation_cache_dir", sys.argv[2])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
bm = {m.name: m for m in MODELS}[sys.argv[1]]
jax.devices()
start = time.perf_counter()
step = jaxdp.make_train_step(bm.loss, optax.adamw(1e-3), mesh=jaxdp.data_mesh(4), accum_steps=2)
state = step.init(bm.make())
state, metrics = step(state, bm.data(4 * 2 * bm.micro_batch_size))
float(metrics["loss"])
print(json.dumps(time.perf_counter() - start))
"""


def first_step(model: str, cache: str) -> float:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run(
        [sys.executable, "-c", ONE, model, cache],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=600,
    )
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for model in ("mlp", "gpt"):
        times: dict[str, list[float]] = {"off": [], "cold": [], "warm": []}
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as cache:
                times["off"].append(first_step(model, ""))
                times["cold"].append(first_step(model, cache))
                times["warm"].append(first_step(model, cache))
        medians = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"{model}: first step after {medians['off']:.2f} s without the cache, "
            f"{medians['cold']:.2f} s cold, {medians['warm']:.2f} s warm "
            f"({medians['off'] / medians['warm']:.1f}x sooner); rounds: "
            + json.dumps({k: [round(t, 2) for t in v] for k, v in times.items()})
        )


if __name__ == "__main__":
    main()

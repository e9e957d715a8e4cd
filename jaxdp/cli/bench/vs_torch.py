"""jaxdp against torch_ref on the same CPU: samples per second, same model, batch and threads.

Single-device gradient accumulation: jaxdp's fused step on one device against
torch_ref's loop in one process, both in this process, timed in turns.
Data parallelism (a CPU EMULATION, not a cluster figure): jaxdp on
``NUM_DEVICES`` emulated CPU devices in this process against torch_ref's DDP
on as many gloo ranks (real processes, each with ``cores / ranks`` threads).
Same global batch throughout: ``num_devices x accum_steps x micro_batch_size``.
A step is one optimizer step and ends by reading the loss on the host.

Threads: both frameworks see the CPUs of this process's affinity (pin a run
with ``taskset -c 0-3 ...``). XLA sizes its CPU thread pools from it; torch
runs on as many threads (``torch.set_num_threads``) and, single-device, also
on one, and its faster setting is the one compared.

Run: ``python -m jaxdp.cli.bench.vs_torch --out DIR [--quick]``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ._common import (
    REFERENCE_MLP,
    BenchModel,
    bench_models,
    cpu_threads,
    interleaved,
    median,
    optimizer,
    standard_args,
)

NUM_DEVICES = 2
GA_ACCUM_STEPS = 4  # single device: global batch = 4 micro-batches
DP_ACCUM_STEPS = 2  # 2 devices x 2 micro-batches: the same global batch


def jaxdp_stepper(bm: BenchModel, *, num_devices: int, accum_steps: int) -> Callable[[], float]:
    """jaxdp's fused step on a pre-placed global batch, reading the loss each step."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..._mesh import data_mesh
    from ..._step import make_train_step

    mesh = data_mesh(num_devices)
    spec = bm.spec()
    step = make_train_step(spec.loss, optimizer(), mesh=mesh, accum_steps=accum_steps)
    rows = num_devices * accum_steps * bm.micro_batch_size
    batch = jax.device_put(bm.data(rows), NamedSharding(mesh, P(mesh.axis_names[0])))
    box = [step.init(spec.make())]

    def run() -> float:
        box[0], metrics = step(box[0], batch)
        # Reading the loss each step, as a training loop logs it; it also keeps
        # XLA's in-process CPU all-reduce from stalling under queued steps.
        return float(metrics["loss"])

    return run


def _row(
    bm: BenchModel,
    mode: str,
    jax_s: list[float],
    torch_s: dict[int, list[float]],
    rows: int,
    *,
    paired: bool,
) -> dict[str, Any]:
    """Medians as samples/s; torch's figure is its best over the thread counts tried.

    ``paired``: sample ``i`` of each was timed in the same round, so the speedup
    is the median of the per-round ratios (steadier on a busy machine); else
    the ratio of the medians.
    """
    jax_sps = rows / median(jax_s)
    by_threads = {threads: rows / median(s) for threads, s in torch_s.items()}
    best = max(by_threads, key=by_threads.get)
    if paired:
        speedup = median([t / j for j, t in zip(jax_s, torch_s[best], strict=True)])
    else:
        speedup = jax_sps / by_threads[best]
    return {
        "model": bm.name,
        "describe": bm.describe(),
        "mode": mode,
        "global_batch_size": rows,
        "micro_batch_size": bm.micro_batch_size,
        "jaxdp_samples_per_second": jax_sps,
        "torch_samples_per_second": by_threads[best],
        "torch_threads": best,
        "torch_samples_per_second_by_threads": by_threads,
        "speedup": speedup,
        "paired": paired,
        "jaxdp_seconds": jax_s,
        "torch_seconds": torch_s,
    }


def measure_ga(
    bm: BenchModel, *, threads: int, repeats: int, sample_seconds: float
) -> dict[str, Any]:
    """In turns: jaxdp, torch_ref on ``threads`` threads and, if more than 1, on 1 thread.

    torch's OpenMP threads wait for each other at every parallel op; on a
    machine shared with other work that can cost far more than the second
    thread gives, so the comparison is with torch's faster setting.
    """
    from ._torch_side import ga_stepper

    variants = {"jaxdp": jaxdp_stepper(bm, num_devices=1, accum_steps=GA_ACCUM_STEPS)}
    for n in dict.fromkeys((threads, 1)):
        variants[f"torch/{n}"], rows = ga_stepper(bm, GA_ACCUM_STEPS, n)
    samples, _ = interleaved(variants, repeats=repeats, sample_seconds=sample_seconds)
    torch_s = {int(k.split("/")[1]): v for k, v in samples.items() if k.startswith("torch")}
    return _row(bm, "accumulation, 1 device", samples["jaxdp"], torch_s, rows, paired=True)


def measure_dp(
    models: Sequence[BenchModel], *, threads: int, repeats: int, sample_seconds: float
) -> list[dict[str, Any]]:
    """jaxdp timed before and after the torch ranks run (they cannot take turns)."""
    from ._torch_side import run_ddp

    steps = [
        jaxdp_stepper(bm, num_devices=NUM_DEVICES, accum_steps=DP_ACCUM_STEPS) for bm in models
    ]

    def time_jaxdp(repeats: int) -> list[list[float]]:
        return [
            interleaved({"jaxdp": step}, repeats=repeats, sample_seconds=sample_seconds)[0]["jaxdp"]
            for step in steps
        ]

    before = time_jaxdp((repeats + 1) // 2)
    ddp = run_ddp(
        models,
        num_devices=NUM_DEVICES,
        accum_steps=DP_ACCUM_STEPS,
        threads=max(1, threads // NUM_DEVICES),
        repeats=repeats,
        sample_seconds=sample_seconds,
    )
    after = time_jaxdp(repeats // 2)
    mode = f"data parallel, {NUM_DEVICES} devices (CPU emulation)"
    rows = []
    for bm, first, second, torch_run in zip(models, before, after, ddp, strict=True):
        global_batch = NUM_DEVICES * DP_ACCUM_STEPS * bm.micro_batch_size
        torch_s = {torch_run["threads"]: torch_run["seconds_per_step"]}
        rows.append(_row(bm, mode, first + second, torch_s, global_batch, paired=False))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = standard_args(__doc__.split("\n")[0], argv)
    from ..._mesh import emulate_cpu_devices

    emulate_cpu_devices(NUM_DEVICES)
    import torch

    started = time.perf_counter()
    threads = cpu_threads()
    torch.set_num_threads(threads)
    models = bench_models(True) if args.quick else (REFERENCE_MLP, *bench_models(False))
    repeats, sample_seconds = (2, 0.01) if args.quick else (9, 0.15)
    rows = [
        measure_ga(bm, threads=threads, repeats=repeats, sample_seconds=sample_seconds)
        for bm in models
    ]
    rows += measure_dp(models, threads=threads, repeats=repeats, sample_seconds=sample_seconds)
    from ._common import write_result

    result = {
        "quick": args.quick,
        "repeats": repeats,
        "sample_seconds": sample_seconds,
        "threads": threads,
        "torch_threads": torch.get_num_threads(),
        "num_devices": NUM_DEVICES,
        "ga_accum_steps": GA_ACCUM_STEPS,
        "dp_accum_steps": DP_ACCUM_STEPS,
        "rows": rows,
    }
    write_result(args.out, "vs_torch", result, started)


if __name__ == "__main__":
    main()

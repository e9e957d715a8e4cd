"""jaxdp against torch_ref on the same CPU: samples per second, same model, batch and threads.

Each framework runs in a process of its own (:mod:`._worker`: jaxdp in a worker,
torch in this process, which runs no XLA computation), and the two are timed
in turns, alternating which goes first: never in one process, where torch's
spinning OpenMP threads slowed the next XLA step by 1.3x.

Single-device gradient accumulation: jaxdp's fused step, the hand-written floor
(:mod:`._hand_written`) and torch_ref's loop. Where the time goes: one
micro-batch's forward, backward and accumulation, and one optimizer update,
in each framework. Data parallelism (a CPU EMULATION, not a cluster figure):
jaxdp on ``NUM_DEVICES`` emulated CPU devices against torch_ref's DDP on as
many gloo ranks (real processes, each with ``cores / ranks`` threads), jaxdp
timed before and after the ranks run. Same global batch throughout:
``num_devices x accum_steps x micro_batch_size``. A step is one optimizer step
and ends by reading the loss on the host.

Threads: both frameworks see the CPUs of this process's affinity (pin a run
with ``taskset -c 0-3 ...``). XLA sizes its CPU thread pools from it; torch
runs on as many threads (``torch.set_num_threads``) and, single-device, also
on one, and its faster setting is the one compared.

Run: ``python -m benchmarks.harness.vs_torch --out DIR [--quick]``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from ._common import (
    MODELS,
    REFERENCE_MLP,
    BenchModel,
    bench_models,
    cpu_threads,
    load_average,
    median,
    standard_args,
)
from ._worker import LocalWorker, Worker

NUM_DEVICES = 2
GA_ACCUM_STEPS = 4  # single device: global batch = 4 micro-batches
DP_ACCUM_STEPS = 2  # 2 devices x 2 micro-batches: the same global batch
COMPONENTS = ("micro", "update")


def _jobs(models: Sequence[BenchModel], threads: int) -> dict[str, list[dict[str, Any]]]:
    """What each worker builds, by key ``framework/kind/model[/threads]``."""
    jaxdp, torch = [], []
    ga = {"num_devices": 1, "accum_steps": GA_ACCUM_STEPS}
    for bm in models:
        model = dataclasses.asdict(bm)
        for kind in ("step", "hand-written"):
            jaxdp.append({"key": f"jaxdp/{kind}/{bm.name}", "model": model, "kind": kind, **ga})
        dp = {"num_devices": NUM_DEVICES, "accum_steps": DP_ACCUM_STEPS}
        jaxdp.append({"key": f"jaxdp/dp/{bm.name}", "model": model, "kind": "step", **dp})
        for n in dict.fromkeys((threads, 1)):
            torch.append(
                {"key": f"torch/step/{bm.name}/{n}", "model": model, "kind": "step"}
                | {"threads": n, "accum_steps": GA_ACCUM_STEPS}
            )
        if bm.name == "mlp-ref":  # framework overhead only: no parts worth timing
            continue
        for kind in COMPONENTS:
            jaxdp.append({"key": f"jaxdp/{kind}/{bm.name}", "model": model, "kind": kind, **ga})
            for n in dict.fromkeys((threads, 1)):
                torch.append(
                    {"key": f"torch/{kind}/{bm.name}/{n}", "model": model, "kind": kind}
                    | {"threads": n}
                )
    return {"jaxdp": jaxdp, "torch": torch}


def in_turns(
    workers: dict[str, Worker | LocalWorker],
    jobs: dict[str, list[dict[str, Any]]],
    *,
    rounds: int,
    samples: int,
    sample_seconds: float,
) -> dict[str, list[float]]:
    """Per key, one figure per round (the median of its samples in that round): each
    round times every key of one worker, then of the other, in alternating order."""
    per_round: dict[str, list[float]] = {j["key"]: [] for js in jobs.values() for j in js}
    last = None
    for r in range(rounds):
        order = list(workers) if r % 2 == 0 else list(workers)[::-1]
        for name in order:
            for job in jobs[name]:
                if job["key"].startswith("jaxdp/dp/"):
                    continue  # timed around the DDP ranks instead
                answer = workers[name].time(
                    job["key"], samples=samples, sample_seconds=sample_seconds, pause=last != name
                )
                per_round[job["key"]].append(median(answer["seconds"]))
                last = name
    return per_round


def _row(
    bm: BenchModel,
    mode: str,
    jax_s: list[float],
    torch_s: dict[int, list[float]],
    rows: int,
    *,
    paired: bool,
    hand_s: list[float] | None = None,
) -> dict[str, Any]:
    """Medians as samples/s; torch's figure is its best over the thread counts tried.

    ``paired``: figure ``i`` of each was timed in the same round, so the speedup
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
    row = {
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
    if hand_s is not None:
        row["hand_written_samples_per_second"] = rows / median(hand_s)
        row["hand_written_speedup"] = median(
            [t / h for h, t in zip(hand_s, torch_s[best], strict=True)]
        )
        row["hand_written_seconds"] = hand_s
    return row


def _torch_by_threads(per_round: dict[str, list[float]], prefix: str) -> dict[int, list[float]]:
    return {int(k.rsplit("/", 1)[1]): v for k, v in per_round.items() if k.startswith(prefix)}


def ga_rows(models: Sequence[BenchModel], per_round: dict[str, list[float]]) -> list[dict]:
    rows = []
    for bm in models:
        rows.append(
            _row(
                bm,
                "accumulation, 1 device",
                per_round[f"jaxdp/step/{bm.name}"],
                _torch_by_threads(per_round, f"torch/step/{bm.name}/"),
                GA_ACCUM_STEPS * bm.micro_batch_size,
                paired=True,
                hand_s=per_round[f"jaxdp/hand-written/{bm.name}"],
            )
        )
    return rows


def component_rows(models: Sequence[BenchModel], per_round: dict[str, list[float]]) -> list[dict]:
    """Seconds of each part of a step, per framework (torch: per thread count)."""
    rows = []
    for bm in models:
        for kind in COMPONENTS:
            if f"jaxdp/{kind}/{bm.name}" not in per_round:
                continue
            torch_s = _torch_by_threads(per_round, f"torch/{kind}/{bm.name}/")
            rows.append(
                {
                    "model": bm.name,
                    "part": kind,
                    "jaxdp_seconds": median(per_round[f"jaxdp/{kind}/{bm.name}"]),
                    "torch_seconds_by_threads": {n: median(s) for n, s in torch_s.items()},
                }
            )
    return rows


def dp_rows(
    models: Sequence[BenchModel],
    worker: Worker,
    *,
    threads: int,
    rounds: int,
    sample_seconds: float,
) -> list[dict[str, Any]]:
    """jaxdp timed before and after the torch ranks run (they cannot take turns)."""
    from ._torch_side import run_ddp

    def time_jaxdp(n: int) -> list[list[float]]:
        return [
            worker.time(
                f"jaxdp/dp/{bm.name}", samples=n, sample_seconds=sample_seconds, pause=True
            )["seconds"]
            for bm in models
        ]

    before = time_jaxdp((rounds + 1) // 2)
    ddp = run_ddp(
        models,
        num_devices=NUM_DEVICES,
        accum_steps=DP_ACCUM_STEPS,
        threads=max(1, threads // NUM_DEVICES),
        repeats=rounds,
        sample_seconds=sample_seconds,
    )
    after = time_jaxdp(max(1, rounds // 2))
    mode = f"data parallel, {NUM_DEVICES} devices (CPU emulation)"
    rows = []
    for bm, first, second, torch_run in zip(models, before, after, ddp, strict=True):
        global_batch = NUM_DEVICES * DP_ACCUM_STEPS * bm.micro_batch_size
        torch_s = {torch_run["threads"]: torch_run["seconds_per_step"]}
        rows.append(_row(bm, mode, first + second, torch_s, global_batch, paired=False))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = standard_args(__doc__.split("\n")[0], argv)
    started, load_start = time.perf_counter(), load_average()
    threads = cpu_threads()
    models = bench_models(True) if args.quick else (REFERENCE_MLP, *MODELS)
    rounds, samples, sample_seconds = (1, 1, 0.01) if args.quick else (5, 2, 0.1)
    jobs = _jobs(models, threads)
    workers = {
        "jaxdp": Worker("jaxdp", jobs["jaxdp"]),
        "torch": LocalWorker("torch", jobs["torch"]),
    }
    try:
        for worker in workers.values():  # built side by side: compiling is not timed
            worker.ready()
        per_round = in_turns(
            workers, jobs, rounds=rounds, samples=samples, sample_seconds=sample_seconds
        )
        workers.pop("torch").close()
        rows = ga_rows(models, per_round)
        rows += dp_rows(
            models, workers["jaxdp"], threads=threads, rounds=rounds, sample_seconds=sample_seconds
        )
    finally:
        for worker in workers.values():
            worker.close()
    from ._common import write_result

    result = {
        "quick": args.quick,
        "rounds": rounds,
        "samples_per_round": samples,
        "sample_seconds": sample_seconds,
        "threads": threads,
        "num_devices": NUM_DEVICES,
        "ga_accum_steps": GA_ACCUM_STEPS,
        "dp_accum_steps": DP_ACCUM_STEPS,
        "load_average_start": load_start,
        "rows": rows,
        "components": component_rows(models, per_round),
    }
    write_result(args.out, "vs_torch", result, started)


if __name__ == "__main__":
    main()

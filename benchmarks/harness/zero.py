"""ZeRO: step time and per-device memory at stages 0, 1 and 2 (and bfloat16 communication).

Time: jaxdp's fused step over ``K`` micro-batches on ``NUM_DEVICES`` emulated CPU
devices (a CPU EMULATION: the collectives are memory copies, not a network),
at each stage. Every variant runs in a worker process of its own
(:mod:`._worker`), so no variant's compiled program, thread pools or caches
touch another's; each round times every variant once, in alternating order,
and each variant's ratio to stage 0 is the median of the per-round ratios.
A step ends by reading the loss on the host. The target (issue 14): stage 1
within 1.10x of stage 0.

Memory: per device, from XLA's memory analysis (nothing allocated): the
compiled fused step (arguments, temporaries, total), and the parameters,
the optimizer state and the float32 gradient accumulator as arguments of a
compiled program that takes them (the accumulator: the multisteps path's
state, which carries it between calls, less the fused path's). Stage 1 should
hold 1/N of stage 0's optimizer state, stage 2 also 1/N of the accumulator,
each plus the leaves kept whole (no dimension that N divides).

Run: ``python -m benchmarks.harness.zero --out DIR [--quick]``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from ._common import BenchModel, bench_models, load_average, median, standard_args
from ._worker import LocalWorker, Worker

NUM_DEVICES, ACCUM_STEPS = 4, 4
QUICK_NUM_DEVICES, QUICK_ACCUM_STEPS = 2, 2
# name -> (zero_stage, comm_dtype); the first is the baseline of every ratio.
VARIANTS = {"0": (0, None), "1": (1, None), "2": (2, None), "1+bf16": (1, "bfloat16")}
BASELINE = "0"
TARGET = ("1", 1.10)  # issue 14, acceptance 5: stage 1 within 1.10x of stage 0


def _key(bm: BenchModel, variant: str) -> str:
    return f"zero/{bm.name}/{variant}"


def _jobs(
    models: Sequence[BenchModel], num_devices: int, k: int, *, one_worker: bool
) -> dict[str, list[dict]]:
    """One worker per variant, each timing that variant for every model (``one_worker``:
    a single worker for all, --quick's smoke run)."""
    jobs: dict[str, list[dict]] = {}
    for variant, (stage, comm_dtype) in VARIANTS.items():
        jobs[variant] = [
            {
                "key": _key(bm, variant),
                "model": dataclasses.asdict(bm),
                "kind": "step",
                "num_devices": num_devices,
                "accum_steps": k,
                "zero_stage": stage,
                "comm_dtype": comm_dtype,
                "memory": True,
            }
            for bm in models
        ]
    if one_worker:
        return {"all": [job for js in jobs.values() for job in js]}
    return jobs


def time_variants(
    models: Sequence[BenchModel],
    num_devices: int,
    k: int,
    *,
    rounds: int,
    samples: int,
    sample_seconds: float,
    one_worker: bool,
    local: bool = False,
) -> tuple[dict[str, list[float]], dict[str, dict[str, Any]]]:
    """Per key, one figure per round (the median of its samples in that round), and
    the workers' memory figures. ``local``: the one worker's steps built and timed in
    this process (whose devices are set), not in a worker process."""
    jobs = _jobs(models, num_devices, k, one_worker=one_worker or local)
    kind = LocalWorker if local else Worker
    workers = {name: kind("jaxdp", js) for name, js in jobs.items()}
    return time_in_turns(
        workers, jobs, rounds=rounds, samples=samples, sample_seconds=sample_seconds
    )


def time_in_turns(
    workers: dict[str, Any],
    jobs: dict[str, list[dict[str, Any]]],
    *,
    rounds: int,
    samples: int,
    sample_seconds: float,
) -> tuple[dict[str, list[float]], dict[str, dict[str, Any]]]:
    """Each worker's jobs timed in turns, the workers' order reversed every other round:
    per key, one figure per round (the median of its samples in that round), and the
    workers' facts. The workers are closed at the end."""
    facts: dict[str, dict[str, Any]] = {}
    try:
        for worker in workers.values():
            facts |= worker.ready()
        per_round: dict[str, list[float]] = {j["key"]: [] for js in jobs.values() for j in js}
        for r in range(rounds):
            order = list(workers) if r % 2 == 0 else list(workers)[::-1]
            for variant in order:
                for job in jobs[variant]:
                    answer = workers[variant].time(
                        job["key"], samples=samples, sample_seconds=sample_seconds, pause=True
                    )
                    per_round[job["key"]].append(median(answer["seconds"]))
    finally:
        for worker in workers.values():
            worker.close()
    return per_round, facts


def _xla_bytes(tree: Any) -> int:
    """Per-device bytes of ``tree``'s arrays as XLA counts a compiled program's arguments."""
    import jax

    from jaxdp.plan import compiled_memory

    program = jax.jit(lambda tree: 0, keep_unused=True).lower(tree).compile()
    return compiled_memory(program).arguments


def memory_facts(
    bm: BenchModel, step: Any, state: Any, batch: Any, mesh: Any, k: int, parallel: Any
) -> dict[str, Any]:
    """XLA's per-device figures for a timing worker's fused ``step`` (compiled here: the
    calls that follow reuse the program), its state's parts, and the collectives the
    compiled step runs per call (an update's branch counted as taken)."""
    import jax
    import numpy as np

    from jaxdp import make_train_step
    from jaxdp.plan import compiled_memory
    from jaxdp.testing import collectives

    from ._common import optimizer

    program = step.compile(state, batch)
    compiled = compiled_memory(program)
    accumulator = None  # regather="window" is fused only: no multisteps state to weigh
    if parallel.regather != "window":
        multi = make_train_step(
            bm.loss, optimizer(), mesh=mesh, accum_steps=k, path="multisteps", parallel=parallel
        ).init(bm.make())
        # The multisteps state carries the float32 gradient sums between calls (and a
        # few scalars); the fused step's live inside it, as temporaries.
        accumulator = _xla_bytes(multi) - _xla_bytes(state)
    sent: dict[str, dict[str, float]] = {}
    for c in collectives(program):
        kind = sent.setdefault(c.kind, {"runs": 0, "ring_bytes": 0.0})
        kind["runs"] += c.executions[1]
        kind["ring_bytes"] += c.executions[1] * c.ring_bytes
    return {
        "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params)),
        "params_bytes": _xla_bytes(state.params),
        "opt_state_bytes": _xla_bytes(state.opt_state),
        "accumulator_bytes": accumulator,
        "step": dataclasses.asdict(compiled) | {"total": compiled.total},
        "collectives": sent,
    }


def model_rows(
    bm: BenchModel, per_round: dict[str, list[float]], facts: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    base = per_round[_key(bm, BASELINE)]
    rows = []
    for variant, (stage, comm_dtype) in VARIANTS.items():
        seconds = per_round[_key(bm, variant)]
        ratios = [a / b for a, b in zip(seconds, base, strict=True)]
        row = {
            "variant": variant,
            "zero_stage": stage,
            "comm_dtype": comm_dtype or "float32",
            "step_seconds": median(seconds),
            "seconds": seconds,
            "compared": {"to": BASELINE, "ratio": median(ratios), "ratios": ratios},
            **{k: v for k, v in facts[_key(bm, variant)].items() if k != "params"},
        }
        if variant == TARGET[0]:
            row["target"] = {"at_most": TARGET[1], "met": row["compared"]["ratio"] <= TARGET[1]}
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None, *, shared: bool = False) -> None:
    """``shared``: in :mod:`._together`'s process, whose devices are set (the first
    ``num_devices`` are used): the steps are timed in it, not in a worker process."""
    args = standard_args(__doc__.split("\n")[0], argv)
    n, k = (QUICK_NUM_DEVICES, QUICK_ACCUM_STEPS) if args.quick else (NUM_DEVICES, ACCUM_STEPS)
    started = time.perf_counter()
    load_start = load_average()
    rounds, samples, sample_seconds = (2, 1, 0.01) if args.quick else (7, 3, 0.2)
    models = bench_models(args.quick)
    per_round, facts = time_variants(
        models,
        n,
        k,
        rounds=rounds,
        samples=samples,
        sample_seconds=sample_seconds,
        one_worker=args.quick,
        local=shared,
    )
    from ._common import write_result

    result = {
        "quick": args.quick,
        "num_devices": n,
        "accum_steps": k,
        "rounds": rounds,
        "samples_per_round": samples,
        "sample_seconds": sample_seconds,
        "workers": 0 if shared else 1 if args.quick else len(VARIANTS),
        "target": {"variant": TARGET[0], "at_most": TARGET[1], "of": BASELINE},
        "load_average_start": load_start,
        "models": [
            {
                "model": bm.name,
                "describe": bm.describe(),
                "params": facts[_key(bm, BASELINE)]["params"],
                "micro_batch_size": bm.micro_batch_size,
                "rows": model_rows(bm, per_round, facts),
            }
            for bm in models
        ],
    }
    write_result(args.out, "zero", result, started)


if __name__ == "__main__":
    main()

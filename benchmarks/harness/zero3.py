"""ZeRO stage 3 and HSDP: step time against stage 2 at K=1 and K=4, and per-device memory.

Time: jaxdp's fused step on ``NUM_DEVICES`` emulated CPU devices (a CPU EMULATION:
the all-gathers and reduce-scatters are memory copies, not a network) for a GPT whose
blocks :func:`jaxdp.scan_layers` loops over (:class:`jaxdp.models.ScannedTransformer`),
at stage 2, stage 3 and HSDP (``shards=2``: 2 replica groups of 2), each in a worker
process of its own (:mod:`._worker`); each round times every variant once, in
alternating order, and a variant's ratio to stage 2 is the median of its per-round
ratios. What it shows is the price of gathering each layer twice per micro-batch and of
the remat that re-runs each layer's forward, on a CPU; no target (issue 32 asks for the
figures).

Memory, at K=``MEMORY_ACCUM_STEPS``: per device, from XLA's memory analysis (nothing
allocated) of the compiled fused step (arguments, temporaries, total) at stages 0, 2
and 3, ``regather="window"`` and HSDP, with the parameters, optimizer state and float32
accumulator as arguments of a compiled program (:func:`.zero.memory_facts`), and the
collectives the compiled step runs per call with what each device sends under ring
algorithms (to hold against docs/scaling-out.md's closed forms). Deterministic.

Not in ``--quick`` (``bin/jaxdp bench --quick`` stays as long): it runs in the full run
and when named, ``bin/jaxdp bench --only zero3``; its ``--quick`` is a smoke size for a
hand check. Run: ``python -m benchmarks.harness.zero3 --out DIR [--quick]``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from ._common import BenchModel, load_average, median, standard_args, write_result
from ._worker import Worker
from .zero import time_in_turns

NUM_DEVICES = 4  # HSDP 2 x 2 needs 4
ACCUM_STEPS = (1, 4)  # the timed K
MEMORY_ACCUM_STEPS = 4
# Four blocks: enough for the layer loop to be a loop; small enough to time in minutes.
MODEL = BenchModel(
    "gpt-scanned",
    "scanned",
    {"vocab_size": 103, "block_size": 64, "d_model": 128, "n_heads": 4, "n_layers": 4},
    16,
)
QUICK_MODEL = BenchModel("gpt-scanned", "scanned", {"n_layers": 2}, 4)
QUICK_ACCUM_STEPS = (1, 2)
# name -> jaxdp.Parallel's fields. Every variant's memory is read; TIMED ones are timed.
VARIANTS: dict[str, dict[str, Any]] = {
    "0": {"zero_stage": 0},
    "2": {"zero_stage": 2},
    "3": {"zero_stage": 3},
    "3, window": {"zero_stage": 3, "regather": "window"},
    "HSDP 2x2": {"zero_stage": 3, "shards": 2},
}
TIMED = ("2", "3", "HSDP 2x2")
BASELINE = "2"


def _key(variant: str, k: int) -> str:
    return f"zero3/{variant}/K={k}"


def _job(bm: BenchModel, variant: str, n: int, k: int, memory_k: int) -> dict[str, Any]:
    return {
        "key": _key(variant, k),
        "model": dataclasses.asdict(bm),
        "kind": "step",
        "num_devices": n,
        "accum_steps": k,
        "parallel": VARIANTS[variant],
        "memory": k == memory_k,
    }


def measure(
    bm: BenchModel,
    n: int,
    ks: Sequence[int],
    memory_k: int,
    *,
    rounds: int,
    samples: int,
    sample_seconds: float,
) -> tuple[dict[str, list[float]], dict[str, dict[str, Any]]]:
    """Per timed key, one figure per round (the median of its samples in that round); and
    every variant's memory facts at ``memory_k``, by key. The untimed variants are
    compiled in one worker that ends before the timing starts."""
    facts: dict[str, dict[str, Any]] = {}
    untimed = [_job(bm, v, n, memory_k, memory_k) for v in VARIANTS if v not in TIMED]
    compiler = Worker("jaxdp", untimed)
    try:
        facts |= compiler.ready()
    finally:
        compiler.close()
    jobs = {v: [_job(bm, v, n, k, memory_k) for k in ks] for v in TIMED}
    workers = {v: Worker("jaxdp", js) for v, js in jobs.items()}  # in TIMED's order
    per_round, timed = time_in_turns(
        workers, jobs, rounds=rounds, samples=samples, sample_seconds=sample_seconds
    )
    return per_round, facts | timed


def timing_rows(per_round: dict[str, list[float]], ks: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for k in ks:
        base = per_round[_key(BASELINE, k)]
        for variant in TIMED:
            seconds = per_round[_key(variant, k)]
            ratios = [a / b for a, b in zip(seconds, base, strict=True)]
            rows.append(
                {
                    "variant": variant,
                    "accum_steps": k,
                    "step_seconds": median(seconds),
                    "seconds": seconds,
                    "compared": {"to": BASELINE, "ratio": median(ratios), "ratios": ratios},
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = standard_args(__doc__.split("\n")[0], argv)
    bm, ks = (QUICK_MODEL, QUICK_ACCUM_STEPS) if args.quick else (MODEL, ACCUM_STEPS)
    memory_k = ks[-1] if args.quick else MEMORY_ACCUM_STEPS
    rounds, samples, sample_seconds = (2, 1, 0.01) if args.quick else (7, 3, 0.2)
    started, load_start = time.perf_counter(), load_average()
    per_round, facts = measure(
        bm,
        NUM_DEVICES,
        ks,
        memory_k,
        rounds=rounds,
        samples=samples,
        sample_seconds=sample_seconds,
    )
    memory_rows = []
    for variant, fields in VARIANTS.items():
        found = facts[_key(variant, memory_k)]
        memory_rows.append({"variant": variant, "parallel": fields} | found)
    result = {
        "quick": args.quick,
        "num_devices": NUM_DEVICES,
        "accum_steps": list(ks),
        "memory_accum_steps": memory_k,
        "rounds": rounds,
        "samples_per_round": samples,
        "sample_seconds": sample_seconds,
        "workers": len(TIMED) + 1,
        "baseline": BASELINE,
        "load_average_start": load_start,
        "model": {
            "model": bm.name,
            "describe": bm.describe(),
            "layers": bm.sizes()["n_layers"],
            "params": facts[_key("0", memory_k)]["params"],
            "micro_batch_size": bm.micro_batch_size,
        },
        "timing": timing_rows(per_round, ks),
        "memory": memory_rows,
    }
    write_result(args.out, "zero3", result, started)


if __name__ == "__main__":
    main()

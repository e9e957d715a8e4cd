"""The loader measurement (``bin/jaxdp bench --only loader``): its BENCHMARKS.md section,
target rows and figure (the slow source's prefetch curve)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._common import markdown_table

LOADER_TARGET = 1.05  # loader-fed step over the pre-placed step, at most (issue 13)
SLOW_TARGET = 1.1  # with a slow source and enough workers, at most (issue 13)
BATCHED_TARGET = 5.0  # an HF Dataset read a call at a time over record by record, at least
RECORD, BATCHED = "HF Dataset, record by record", "HF Dataset, batched (jaxdp)"


def _verdict(value: float, bound: float) -> str:
    return "met" if value <= bound else f"**missed** by {(value - bound) / bound:.0%} of the target"


def loader_targets(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for model in result["models"]:
        worst = max(model["rows"], key=lambda r: r["ratio"])
        rows.append(
            [
                f"loader-fed step <= {LOADER_TARGET} x pre-placed step, both paths "
                f"({model['model']})",
                f"worst {worst['ratio']:.3f} ({worst['path']})",
                _verdict(worst["ratio"], LOADER_TARGET),
            ]
        )
    slow = result["slow_source"]
    best = min(slow["rows"], key=lambda r: r["ratio"])
    rows.append(
        [
            f"slow source: loader-fed step <= {SLOW_TARGET} x pre-placed step with enough workers",
            f"{best['ratio']:.3f} (workers={best['workers']})",
            _verdict(best["ratio"], SLOW_TARGET),
        ]
    )
    rates = {k["source"]: k["rows_per_second"] for k in result.get("sources", {}).get("kinds", [])}
    if RECORD in rates and BATCHED in rates:
        speedup = rates[BATCHED] / rates[RECORD]
        rows.append(
            [
                f"HF Dataset through the loader: batched read >= {BATCHED_TARGET:g} x record "
                "by record (issue 26)",
                f"{speedup:.1f}x ({rates[BATCHED]:,.0f} against {rates[RECORD]:,.0f} rows/s)",
                "met" if speedup >= BATCHED_TARGET else "**missed**",
            ]
        )
    return rows


def _sources(result: dict[str, Any]) -> list[str]:
    """The sources' table (absent from results before issue 26)."""
    if "sources" not in result:
        return []
    sources = result["sources"]
    base = {k["source"]: k["rows_per_second"] for k in sources["kinds"]}.get(RECORD)
    table = [
        [
            k["source"],
            f"{k['rows_per_second']:,.0f}",
            f"{k['rows_per_second'] / base:.1f}x" if base else "-",
        ]
        for k in sources["kinds"]
    ]
    return [
        f"Sources: rows per second through the loader ({sources['workers']} worker thread; "
        f"read, stacked and placed), fused calls of {sources['global_batch_size']} shuffled "
        f"rows from {sources['rows']:,} rows of {sources['features']} float32 features and "
        "an integer label. The HF rows read a `datasets.Dataset` in its default format; "
        "record by record is how the loader read one before issue 26; HF's own "
        "`ds[rows]` (numpy format, no loader) is the ceiling.",
        markdown_table(["source", "rows/s", "over record by record"], table),
    ]


def loader_section(result: dict[str, Any]) -> str:
    overhead = [
        [
            m["model"],
            r["path"],
            f"{r['pre_placed_seconds'] * 1e3:.2f} ms",
            f"{r['step_seconds'] * 1e3:.2f} ms",
            f"**{r['ratio']:.3f}**",
        ]
        for m in result["models"]
        for r in m["rows"]
    ]
    slow = result["slow_source"]
    curve = [
        [r["workers"], f"{r['step_seconds'] * 1e3:.2f} ms", f"{r['ratio']:.3f}"]
        for r in slow["rows"]
    ]
    memory = [
        [
            m["prefetch"],
            m["workers"],
            m["placed_batches_alive"],
            f"{m['placed_bytes']:,} B ({m['placed_bytes'] / m['batch_bytes']:.1f} batches)",
            m["calls_read"],
        ]
        for m in result["memory"]
    ]
    return "\n\n".join(
        [
            f"{result['num_devices']} emulated devices, accum_steps={result['accum_steps']}; "
            f"median of {result['repeats']} interleaved repeats.",
            markdown_table(
                ["model", "path", "pre-placed step", "loader-fed step", "ratio"], overhead
            ),
            f"Slow source ({slow['model']}): every row read sleeps "
            f"{slow['delay_per_record_seconds'] * 1e6:.1f} us, so one global batch read on one "
            f"thread takes {slow['single_thread_read_seconds'] * 1e3:.2f} ms against a "
            f"pre-placed step of {slow['pre_placed_seconds'] * 1e3:.2f} ms.",
            markdown_table(["workers", "loader-fed step", "over pre-placed"], curve),
            "Held while the loop takes no batch (after one): placed batches alive on the "
            "devices (the loop's last one and one waiting for the full queue included: at "
            "most prefetch + 2) and calls read from the source (the first included).",
            markdown_table(
                ["prefetch", "workers", "placed batches alive", "their bytes", "calls read"],
                memory,
            ),
            *_sources(result),
        ]
    )


def loader_figure(result: dict[str, Any], path: Path) -> None:
    from ._plots import _pyplot, _save

    plt = _pyplot()
    slow = result["slow_source"]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    workers = [r["workers"] for r in slow["rows"]]
    ax.plot(workers, [r["ratio"] for r in slow["rows"]], "o-", label="loader-fed / pre-placed")
    lo = [min(r["ratios"]) for r in slow["rows"]]
    hi = [max(r["ratios"]) for r in slow["rows"]]
    ax.fill_between(workers, lo, hi, alpha=0.15)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(SLOW_TARGET, color="red", lw=0.8, ls="--", label=f"target {SLOW_TARGET}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("loader workers (threads)")
    ax.set_ylabel("time per optimizer step, ratio")
    ax.set_title(f"Slow source, {slow['model']}: one batch read = one step", fontsize=9)
    ax.legend(fontsize=7)
    _save(plt, fig, path)

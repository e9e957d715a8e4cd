"""Results JSON -> PNG figures and the generated parts of BENCHMARKS.md.

Every generated part sits between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->`` in the markdown file; the text around them is
written by hand (what the figures mean, why a target is missed) and kept.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from . import _plots
from ._common import markdown_table
from ._render_loader import loader_section
from ._targets import targets_section

# BENCHMARKS.md's generated sections, in order, and the results they are made from.
SECTIONS = ("run", "targets", "overhead", "vs_torch", "comms", "ring", "memory", "zero")
SECTIONS += ("zero3", "loader", "gpu", "gpu_programs")
CPU_RESULTS = ("overhead", "vs_torch", "comms", "memory", "zero")
RESULTS = ("run", *CPU_RESULTS, "zero3", "loader", "gpu", "gpu_programs")
_KINDS = ("all-gather", "reduce-scatter", "all-reduce")  # zero3's collectives, in this order


def load(out: Path) -> dict[str, dict[str, Any]]:
    return {
        n: json.loads((out / f"{n}.json").read_text())
        for n in RESULTS
        if (out / f"{n}.json").exists()
    }


def megabytes(n: float) -> str:
    return f"{n / 1e6:,.2f} MB" if n >= 1e5 else f"{n:,.0f} B"


def _figure(name: str, out: Path, markdown: Path) -> str:
    rel = os.path.relpath(out / f"{name}.png", markdown.parent)
    return f"![{name}]({Path(rel).as_posix()})"


# ---- sections ------------------------------------------------------------------------------


def run_section(r: dict[str, dict[str, Any]]) -> str:
    run = r.get("run", {})
    env = next((r[n]["env"] for n in RESULTS[1:] if n in r), None)
    if env is None:
        return "_No results yet: run `bin/jaxdp bench`._"
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    walls = ", ".join(f"{n} {r[n]['wall_seconds']:.0f} s" for n in CPU_RESULTS if n in r)
    lines = [
        f"- Command: `{run.get('command', 'bin/jaxdp bench')}`"
        + (" (quick smoke sizes)" if run.get("quick") else ""),
        f"- Wall time: {run['wall_seconds']:.0f} s in all ({walls})" if run else f"- {walls}",
        f"- Machine: {env['cpu']}, {env['cpu_count']} CPUs, {env['cpu_threads']} in this "
        f"run's affinity; {env['platform']}; Python {env['python']}",
        f"- Versions: {versions}",
        "- Load average (1 min; 2.0 is both cores busy with this run alone): "
        + "; ".join(f"{n} {_load(r[n])}" for n in CPU_RESULTS if n in r),
    ]
    return "\n".join(lines)


def _ratio(row: dict[str, Any], key: str = "compared") -> str:
    c = row[key]
    return f"**{c['ratio']:.3f}** ({min(c['ratios']):.2f}-{max(c['ratios']):.2f})"


def overhead_section(o: dict[str, Any]) -> str:
    parts = []
    for m in o["models"]:
        rows = []
        for k in o["accum_steps"]:
            by_path = {r["path"]: r for r in m["rows"] if r["accum_steps"] == k}
            cells = [k, f"{1e3 * by_path['hand-written']['step_seconds']:.2f}"]
            for path in ("fused", "hand-written streaming", "multisteps", "optax.MultiSteps"):
                cells += [f"{1e3 * by_path[path]['step_seconds']:.2f}", _ratio(by_path[path])]
            cells.insert(8, _ratio(by_path["multisteps"], "to_streaming"))
            rows.append(cells)
        head = ["K", "hand-written ms", "jaxdp fused ms", "fused / hand-written"]
        head += ["hand-written streaming ms", "streaming / fused"]
        head += ["jaxdp multisteps ms", "multisteps / fused", "multisteps / streaming"]
        head += ["jit + optax.MultiSteps ms", "optax.MultiSteps / fused"]
        parts.append(
            f"**{m['model']}**: {m['describe']}, micro-batch {m['micro_batch_size']} rows; "
            f"one micro-batch forward+backward {1e3 * m['micro_seconds']:.2f} ms, "
            f"one optimizer update {1e3 * m['update_seconds']:.2f} ms, one pass `acc += grads` "
            f"{1e3 * m['accumulate_seconds']:.2f} ms (medians).\n\n" + markdown_table(head, rows)
        )
    return "\n\n".join(parts) + (
        f"\n\nTime per optimizer step (the streaming ones: K calls, and one more for the "
        f"hand-written streaming step), medians of {o['repeats']} repeats in turns on "
        f"{o['num_devices']} device; each ratio is the median of the per-repeat ratios (in "
        f"parentheses their range). Load average (1 min): {_load(o)}."
    )


def _load(result: dict[str, Any]) -> str:
    end = result["env"]["load_average_end"][0]
    start = result.get("load_average_start")
    return f"{start:.1f} at the start, {end:.1f} at the end" if start is not None else f"{end:.1f}"


def vs_torch_section(v: dict[str, Any]) -> str:
    rows = [
        [
            r["model"],
            r["describe"],
            r["mode"],
            r["global_batch_size"],
            f"{r['jaxdp_samples_per_second']:,.0f}",
            _hand(r, "hand_written_samples_per_second", "{:,.0f}"),
            f"{r['torch_samples_per_second']:,.0f} ({r['torch_threads']})",
            _other_threads(r),
            f"**{r['speedup']:.2f}x**",
            _hand(r, "hand_written_speedup", "{:.2f}x"),
        ]
        for r in v["rows"]
    ]
    head = ["model", "layout", "mode", "global batch", "jaxdp samples/s"]
    head += ["hand-written samples/s", "torch_ref samples/s (threads)", "other threads"]
    head += ["jaxdp / torch_ref", "hand-written / torch_ref"]
    return (
        markdown_table(head, rows)
        + (
            f"\n\nEach framework in its own process, timed in turns ({v['rounds']} rounds "
            f"alternating which goes first, {v['samples_per_round']} samples a turn after warm-up "
            f"calls). Threads: XLA uses the process's {v['threads']} CPUs (its affinity); "
            f"torch_ref runs on {v['threads']} and on 1 thread (`set_num_threads`) and the faster "
            f"counts; DDP ranks get {v['threads']} / {v['num_devices']} each. Accumulation: "
            f"K={v['ga_accum_steps']} on 1 device; data parallel: {v['num_devices']} devices x "
            f"K={v['dp_accum_steps']}. Medians; the accumulation speedups are medians of "
            "per-round ratios, the data-parallel one the ratio of medians (jaxdp timed before "
            f"and after the torch ranks). Load average (1 min): {_load(v)}."
        )
        + "\n\n"
        + components_table(v)
    )


def _other_threads(r: dict[str, Any]) -> str:
    others = {int(k): v for k, v in r["torch_samples_per_second_by_threads"].items()}
    others.pop(r["torch_threads"])
    return ", ".join(f"{v:,.0f} ({k})" for k, v in others.items()) or "-"


def _hand(r: dict[str, Any], key: str, fmt: str) -> str:
    return fmt.format(r[key]) if key in r else "-"


def components_table(v: dict[str, Any]) -> str:
    """Where a step's time goes: each part timed alone in each framework."""
    rows = []
    for c in v.get("components", []):
        torch_s = {int(n): s for n, s in c["torch_seconds_by_threads"].items()}
        best = min(torch_s.values())
        cells = [c["model"], PARTS[c["part"]], f"{1e3 * c['jaxdp_seconds']:.3f}"]
        cells += [f"{1e3 * s:.3f}" for _, s in sorted(torch_s.items(), reverse=True)]
        rows.append([*cells, f"**{c['jaxdp_seconds'] / best:.2f}**"])
    if not rows:
        return ""
    threads = sorted({int(n) for c in v["components"] for n in c["torch_seconds_by_threads"]})
    head = ["model", "part", "XLA (jaxdp) ms"]
    head += [f"torch_ref ms ({n} thread{'s' * (n > 1)})" for n in threads[::-1]]
    return (
        "Where the time goes, each part timed alone in its framework's process:\n\n"
        + markdown_table([*head, "XLA / faster torch"], rows)
    )


PARTS = {
    "micro": "one micro-batch: forward, backward, `acc += grads`",
    "update": "one optimizer update (AdamW)",
}


def comms_section(c: dict[str, Any]) -> str:
    parts = []
    for m in c["models"]:
        rows = [
            [
                r["path"],
                r["accum_steps"],
                f"{r['executions_per_step']:g}",
                f"{r['bytes_per_step']:,.0f}",
                f"{r['ratio_to_gradient_bytes']:.4f}",
            ]
            for r in m["rows"]
        ]
        parts.append(
            f"**{m['model']}** ({m['describe']}): {m['params']:,} parameters, gradient "
            f"{m['gradient_bytes']:,} bytes (float32), {c['num_devices']} devices.\n\n"
            + markdown_table(
                ["path", "K", "all-reduces / step", "bytes / step", "/ gradient bytes"], rows
            )
        )
    return "\n\n".join(parts)


def ring_section(c: dict[str, Any]) -> str:
    links = list(c["links"])
    rows = []
    for model in dict.fromkeys(r["model"] for r in c["ring"]):
        for n in c["ring_devices"]:
            cells = [model, n]
            for link in links:
                (r,) = [
                    x
                    for x in c["ring"]
                    if x["model"] == model and x["link"] == link and x["num_devices"] == n
                ]
                cells.append(f"{1e3 * r['seconds']:.4g} ({1e3 * r['naive_seconds']:.4g})")
            cells.insert(1, megabytes(r["payload_bytes"]))
            rows.append(cells)
    head = ["model", "gradient", "GPUs N"] + [
        f"{link}: ms (naive K={c['naive_factor']})" for link in links
    ]
    return markdown_table(head, rows)


def memory_section(m: dict[str, Any]) -> str:
    parts = []
    for model in m["models"]:
        rows = [
            [
                r["accum_steps"],
                r["micro_batch_size"],
                megabytes(r["fused"]["arguments"]),
                megabytes(r["fused"]["temporaries"]),
                megabytes(r["fused"]["total"]),
                megabytes(r["single_micro_batch"]["temporaries"]),
                f"**{r['temp_ratio']:.3f}**",
                megabytes(r["excess_bytes"]),
                megabytes(r["accumulator_bytes"] + r["micro_input_bytes"]),
            ]
            for r in model["rows"]
        ]
        without, with_accum = (
            model["largest_without_accumulation"],
            model["largest_with_accumulation"],
        )
        ms = model["multisteps_micro_step"]
        parts.append(
            f"**{model['model']}** ({model['describe']}), global batch {model['global_batch_size']}"
            f" on {m['num_devices']} devices, per device:\n\n"
            + markdown_table(
                [
                    "K",
                    "micro-batch",
                    "arguments",
                    "temporaries",
                    "total",
                    "one micro-batch step: temporaries",
                    "temp ratio",
                    "excess",
                    "accumulator + micro-batch inputs",
                ],
                rows,
            )
            + f"\n\nLargest global batch within {m['budget'] / 2**20:.0f} MiB per device: "
            f"**{without['global_batch_size']:,}** without accumulation (micro-batch "
            f"{without['micro_batch_size']:,}), **{with_accum['global_batch_size']:,}** with the "
            f"fused path (micro-batch {with_accum['micro_batch_size']} x K="
            f"{with_accum['accum_steps']:,}; {with_accum['compiles']} and {without['compiles']} "
            f"compiles). The multisteps step at micro-batch {with_accum['micro_batch_size']}: "
            f"{megabytes(ms['total'])} for any K."
        )
    return "\n\n".join(parts)


def zero_section(z: dict[str, Any]) -> str:
    parts = []
    for m in z["models"]:
        rows = []
        for r in m["rows"]:
            target = r.get("target")
            check = "-" if target is None else ("met" if target["met"] else "**missed**")
            rows.append(
                [
                    r["variant"],
                    r["comm_dtype"],
                    f"{1e3 * r['step_seconds']:.2f}",
                    _ratio(r),
                    check,
                    megabytes(r["params_bytes"]),
                    megabytes(r["opt_state_bytes"]),
                    megabytes(r["accumulator_bytes"]),
                    megabytes(r["step"]["total"]),
                ]
            )
        head = ["stage", "comm", "ms / step", "/ stage 0", "target", "params", "optimizer state"]
        head += ["float32 accumulator", "compiled step total"]
        parts.append(
            f"**{m['model']}** ({m['describe']}, {m['params']:,} parameters), micro-batch "
            f"{m['micro_batch_size']} x K={z['accum_steps']} on {z['num_devices']} emulated "
            "CPU devices, per device:\n\n" + markdown_table(head, rows)
        )
    t = z["target"]
    workers = (
        f"{z['workers']} worker process(es) (one per variant but in --quick)"
        if z["workers"]
        else "Timed in the process of --quick's other XLA measurements"
    )
    return "\n\n".join(parts) + (
        f"\n\nTarget: stage {t['variant']} at most {t['at_most']:.2f}x stage {t['of']}. "
        f"{workers}, timed in turns over "
        f"{z['rounds']} rounds in alternating order, {z['samples_per_round']} samples a turn; "
        "ratios are medians of per-round ratios (in parentheses their range). Bytes from XLA's "
        "memory analysis: the parts as arguments of a compiled program, the accumulator the "
        "multisteps state less the fused one, the total the compiled fused step's. "
        f"Load average (1 min): {_load(z)}."
    )


def zero3_section(z: dict[str, Any]) -> str:
    m = z["model"]
    timing = [
        [r["variant"], r["accum_steps"], f"{1e3 * r['step_seconds']:.2f}", _ratio(r)]
        for r in z["timing"]
    ]
    memory = []
    for r in z["memory"]:
        sent = r["collectives"]
        runs = [sent.get(kind, {}).get("runs", 0) for kind in _KINDS]
        ring = sum(c["ring_bytes"] for c in sent.values())
        accumulator = r["accumulator_bytes"]
        memory.append(
            [
                r["variant"],
                megabytes(r["params_bytes"]),
                megabytes(r["opt_state_bytes"]),
                "-" if accumulator is None else megabytes(accumulator),
                megabytes(r["step"]["arguments"]),
                megabytes(r["step"]["temporaries"]),
                f"**{megabytes(r['step']['arguments'] + r['step']['temporaries'])}**",
                " / ".join(str(n) for n in runs),
                megabytes(ring),
            ]
        )
    head = ["variant", "params", "optimizer state", "float32 accumulator", "arguments"]
    head += ["temporaries", "arguments + temporaries"]
    head += ["all-gathers / reduce-scatters / all-reduces per step", "ring bytes per device"]
    return (
        f"**{m['model']}** ({m['describe']}, {m['params']:,} parameters), micro-batch "
        f"{m['micro_batch_size']} on {z['num_devices']} emulated CPU devices. Step time "
        f"against stage {z['baseline']}:\n\n"
        + markdown_table(["variant", "K", "ms / step", f"/ stage {z['baseline']}"], timing)
        + f"\n\nPer device at K={z['memory_accum_steps']}, from XLA's memory analysis of "
        "the compiled fused step, and the collectives it runs per call (the update's "
        "branch taken):\n\n"
        + markdown_table(head, memory)
        + f"\n\n{z['workers'] - 1} timing worker process(es), one per timed variant (and one "
        f"that compiles the others first), timed in turns over {z['rounds']} rounds in "
        f"alternating order, {z['samples_per_round']} samples a turn; ratios are medians of "
        'per-round ratios (in parentheses their range). `-`: `regather="window"` runs on '
        "the fused path only, whose accumulator is among the temporaries. Load average "
        f"(1 min): {_load(z)}."
    )


def gpu_section(g: dict[str, Any] | None) -> str:
    if g is None or g.get("tiny"):
        return (
            "_Pending a lent GPU: no GPU was available to the session that made this file. "
            "The script is ready: `python3 benchmarks/gpu_checks.py --out DIR` (or "
            "`bin/jaxdp bench --only gpu`) on a machine with jax[cuda] and torch._"
        )
    d = g["device"]
    t = d.get("torch") if isinstance(d.get("torch"), dict) else {}
    labels = {
        "jaxdp": "jaxdp fused, stage 0",
        "jaxdp_multisteps": "jaxdp multisteps, stage 0 (K calls)",
        "jaxdp_zero1": "jaxdp fused, ZeRO-1",
        "torch": "torch.compile" if g.get("torch", {}).get("compiled") else "torch eager",
    }
    rows = []
    for name, label in labels.items():
        if name in g:
            s = g[name]
            rows.append(
                [
                    label,
                    f"{1e3 * s['step_seconds']:.1f}",
                    f"{s['tokens_per_second']:,.0f}",
                    f"**{100 * s['mfu']['6N+attention']:.1f}%**",
                    f"{100 * s['mfu']['6N']:.1f}%",
                ]
            )
    where = (
        "each framework in a process of its own" if g.get("separate_processes") else "one process"
    )
    return (
        f"{t.get('device') or d.get('torch_device') or d['jax_device']}; jax {d['jax']}, torch "
        f"{t.get('version') or d.get('torch')}, CUDA {t.get('cuda') or d.get('cuda')}; {where}. "
        f"Measured bf16 matmul peak ({g['peak']['n']}^3 `jnp.dot`): "
        f"{g['peak']['flops_per_second'] / 1e12:.0f} TFLOP/s. {g['params']:,} parameters, "
        f"micro-batch {g['micro_batch_size']} x {g['config']['block_size']} tokens, K="
        f"{g['accum_steps']}: {g['tokens_per_step']:,} tokens per step.\n\n"
        + markdown_table(["", "ms / step", "tokens/s", "MFU (6N + attention)", "MFU (6N)"], rows)
    )


def gpu_programs_section(g: dict[str, Any]) -> str:
    """Per topology, the compiled step's gradient buckets, the share of their bytes with
    compute scheduled under them, and each device's peak beside the plan's."""
    m = g["model"]
    parts = [
        f"GPT-2 small ({m['n_layer']} blocks of width {m['d_model']}, vocabulary "
        f"{m['vocab_size']}, {m['block_size']} positions, head tied to the token embedding), "
        f"float32 parameters, bf16 compute, AdamW, {g['micro_batch_size']} sequences per "
        f"micro-batch and device; target `{g['target']}`, `bucket_cap_mb={g['bucket_cap_mb']}`. "
        "Compiled by XLA:GPU on a CPU machine; nothing ran."
    ]
    header = [
        "stage, path, K",
        "gradient collectives per step",
        "MB per step",
        "in the micro-batch loop",
        "hidden (all)",
        "hidden (but the tied embedding)",
        "the tied embedding's hidden",
        "all-gathers",
        "peak per device (XLA)",
        "`jaxdp plan`",
        "compile",
    ]
    for topology in dict.fromkeys(r["topology"] for r in g["rows"]):
        rows = []
        for r in (r for r in g["rows"] if r["topology"] == topology):
            peak = r["memory"]["peak"] or 0
            rows.append(
                [
                    f"{r['zero_stage']}, {r['path']}, {r['accum_steps']}",
                    f"{r['gradient_collectives']} {r['gradient_kind']}s",
                    f"{r['gradient_bytes'] / 1e6:,.1f}",
                    r["in_loop"],
                    f"{r['hidden_share']:.1%}",
                    f"**{r['hidden_share_but_tied']:.1%}**",
                    {True: "yes", False: "no", None: "-"}[r.get("tied_hidden")],
                    r["all_gathers"],
                    f"{peak / 2**30:.2f} GiB",
                    f"{r['plan_bytes'] / 2**30:.2f} GiB ({peak / r['plan_bytes']:.2f}x)",
                    f"{r['compile_seconds']:.0f} s",
                ]
            )
        devices = next(r["devices"] for r in g["rows"] if r["topology"] == topology)
        parts.append(f"`{topology}` ({devices} H100s):\n\n" + markdown_table(header, rows))
    if g.get("stage_3"):
        parts.append(_stage_3_programs(g["stage_3"]))
    if g.get("scanned"):
        parts.append(_scanned_programs(g["scanned"]))
    return "\n\n".join(parts)


def _scanned_programs(cells: list[dict[str, Any]]) -> str:
    """Stages 0 to 2 on the scanned model, its stack undeclared and declared
    (``Parallel(layers=...)``): the share of the gradient bytes hidden."""
    header = ["topology", "stage, path, K", "stack", "gradient collectives", "hidden (all)"]
    header += ["hidden (but the embeddings)", "compile"]
    rows = [
        [
            f"`{r['topology']}`",
            f"{r['zero_stage']}, {r['path']}, {r['accum_steps']}",
            "declared" if r["declared"] else "-",
            r["gradient_collectives"],
            f"{r['hidden_share']:.1%}",
            f"**{r['hidden_share_but_embeddings']:.1%}**",
            f"{r['compile_seconds']:.0f} s",
        ]
        for r in cells
    ]
    return (
        "The scanned GPT-2-small-sized model (the stage-3 rows' model, an untied head) at "
        "stages 0 to 2, its blocks undeclared and declared a stack of layers (by its "
        "metadata: each layer's gradients leave the unrolled loop's backward as the layer "
        "ends, in one collective per layer); the embeddings: the token embedding's and the "
        "head's, 154.5 MB each:\n\n" + markdown_table(header, rows)
    )


def _stage_3_programs(cells: list[dict[str, Any]]) -> str:
    """Stage 3 and HSDP on the scanned model: the gathers' and reduce-scatters' shares
    under matrix products, the backward's matrix FLOPs over the forward's, the peak."""

    def share(c: dict[str, Any]) -> str:
        return (
            f"{c['collectives']} / {c['bytes'] / 1e6:,.0f} MB / {c['hidden_share']:.0%} / "
            f"**{c['hidden_share_but_first_and_last']:.0%}**"
        )

    rows = []
    for r in cells:
        layout = f"`{r['topology']}`" + (f", shards {r['shards']}" if r["shards"] else "")
        if r.get("replica_all_reduce") == "after_backward":
            layout += ", all-reduce after the backward"
        peak = r["memory"]["peak"] or 0
        flops = r.get("backward_over_forward_flops")
        across = r.get("all-reduce")
        rows.append(
            [
                f"{layout}, K={r['accum_steps']}, remat `{r['remat']}`",
                share(r["all-gather"]),
                share(r["reduce-scatter"]),
                "-"
                if across is None
                else f"{across['bytes'] / 1e6:,.0f} MB / {across['hidden_share']:.0%} / "
                f"**{across['hidden_share_but_embeddings']:.0%}**",
                "-" if flops is None else f"{flops:.2f}",
                f"{peak / 2**30:.2f} GiB",
                f"{r['plan_bytes'] / 2**30:.2f} GiB ({peak / r['plan_bytes']:.2f}x)",
                f"{r['compile_seconds']:.0f} s",
            ]
        )
    header = [
        "stage 3",
        "all-gathers: per step / bytes / hidden (all) / hidden (but first, last)",
        "reduce-scatters: the same",
        "HSDP's all-reduces across the replica groups: bytes / hidden (all) / hidden (but "
        "the embedding-sized blocks)",
        "backward / forward matrix FLOPs (layer loops)",
        "peak per device (XLA)",
        "`jaxdp plan`",
        "compile",
    ]
    return (
        "Stage 3 and HSDP, a scanned GPT-2-small-sized model (`jaxdp.models.ScannedTransformer`, "
        '12 blocks of width 768 looped by `jaxdp.scan_layers`, untied head; "first, last": '
        "the collectives of each micro-batch's token embedding and of a whole float32 block, "
        "gathered first and reduce-scattered last, left out by their sizes, the untied head's "
        "reduce-scatter, of the token embedding's size, with them):\n\n"
        + markdown_table(header, rows)
    )


# ---- writing -----------------------------------------------------------------------------------

TEMPLATE = "# jaxdp benchmarks\n\n" + "".join(
    f"## {name}\n\n<!-- bench:{name} -->\n<!-- /bench:{name} -->\n\n" for name in SECTIONS
)


def sections(r: dict[str, dict[str, Any]], out: Path, markdown: Path) -> dict[str, str]:
    s = {"run": run_section(r), "targets": targets_section(r), "gpu": gpu_section(r.get("gpu"))}
    builders = {
        "overhead": overhead_section,
        "vs_torch": vs_torch_section,
        "comms": comms_section,
        "memory": memory_section,
        "zero": zero_section,
        "loader": loader_section,
    }
    for name, build in builders.items():
        if name in r:
            s[name] = build(r[name]) + "\n\n" + _figure(name, out, markdown)
    if "zero3" in r:  # tables only
        s["zero3"] = zero3_section(r["zero3"])
    if "comms" in r:
        s["ring"] = ring_section(r["comms"])
    if "gpu_programs" in r:
        s["gpu_programs"] = gpu_programs_section(r["gpu_programs"])
    s.setdefault(
        "gpu_programs",
        "Not measured yet: it runs only when named, `bin/jaxdp bench --only gpu_programs`.",
    )
    s.setdefault(
        "loader", "Not measured yet: it runs only when named, `bin/jaxdp bench --only loader`."
    )
    s.setdefault(
        "zero3",
        "Not measured yet: it runs in the full run, not in --quick "
        "(`bin/jaxdp bench --only zero3`).",
    )
    return s


def write_markdown(markdown: Path, parts: dict[str, str]) -> None:
    text = markdown.read_text() if markdown.exists() else TEMPLATE
    for name, body in parts.items():
        pattern = re.compile(rf"(<!-- bench:{name} -->\n).*?(<!-- /bench:{name} -->)", re.S)
        if pattern.search(text):
            text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
        else:
            text += f"\n<!-- bench:{name} -->\n{body}\n<!-- /bench:{name} -->\n"
    markdown.write_text(text)


def render(out: Path, markdown: Path | None) -> dict[str, dict[str, Any]]:
    """Draws every figure whose results exist, and fills the markdown's generated parts."""
    results = load(out)
    for name, draw in _plots.FIGURES.items():
        if name in results:
            draw(results[name], out / f"{name}.png")
    if markdown is not None:
        write_markdown(markdown, sections(results, out, markdown))
    return results

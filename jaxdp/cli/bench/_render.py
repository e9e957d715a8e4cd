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

SECTIONS = ("run", "targets", "overhead", "vs_torch", "comms", "ring", "memory", "gpu")
RESULTS = ("run", "overhead", "vs_torch", "comms", "memory", "gpu")


def load(out: Path) -> dict[str, dict[str, Any]]:
    return {
        n: json.loads((out / f"{n}.json").read_text())
        for n in RESULTS
        if (out / f"{n}.json").exists()
    }


def megabytes(n: float) -> str:
    return f"{n / 1e6:,.2f} MB" if n >= 1e5 else f"{n:,.0f} B"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


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
    walls = ", ".join(f"{n} {r[n]['wall_seconds']:.0f} s" for n in RESULTS[1:5] if n in r)
    lines = [
        f"- Command: `{run.get('command', 'bin/jaxdp bench')}`"
        + (" (quick smoke sizes)" if run.get("quick") else ""),
        f"- Wall time: {run['wall_seconds']:.0f} s in all ({walls})" if run else f"- {walls}",
        f"- Machine: {env['cpu']}, {env['cpu_count']} CPUs, {env['cpu_threads']} in this "
        f"run's affinity; {env['platform']}; Python {env['python']}",
        f"- Versions: {versions}",
        "- Load average at the end of each measurement (1 min): "
        + ", ".join(
            f"{n} {r[n]['env']['load_average_end'][0]:.1f}" for n in RESULTS[1:5] if n in r
        ),
    ]
    return "\n".join(lines)


def overhead_section(o: dict[str, Any]) -> str:
    parts = []
    for m in o["models"]:
        rows = [
            [
                r["path"],
                r["accum_steps"],
                f"{1e3 * r['step_seconds']:.2f}",
                f"{1e3 * r['floor_seconds']:.2f}",
                f"**{r['ratio']:.3f}**",
                f"{min(r['ratios']):.3f}-{max(r['ratios']):.3f}",
            ]
            for r in m["rows"]
        ]
        parts.append(
            f"**{m['model']}**: {m['describe']}, micro-batch {m['micro_batch_size']} rows; "
            f"one micro-batch forward+backward {1e3 * m['micro_seconds']:.2f} ms, "
            f"one optimizer update {1e3 * m['update_seconds']:.2f} ms, one pass `acc += grads` "
            f"{1e3 * m['accumulate_seconds']:.2f} ms (medians).\n\n"
            + _table(
                ["path", "K", "ms / step", "floor ms", "step / floor", "per-repeat range"], rows
            )
        )
    return "\n\n".join(parts) + (
        f"\n\n{o['repeats']} repeats in turns, {o['num_devices']} device; step / floor is the "
        "median of the per-repeat ratios."
    )


def vs_torch_section(v: dict[str, Any]) -> str:
    rows = [
        [
            r["model"],
            r["describe"],
            r["mode"],
            r["global_batch_size"],
            f"{r['jaxdp_samples_per_second']:,.0f}",
            f"{r['torch_samples_per_second']:,.0f} ({r['torch_threads']})",
            _other_threads(r),
            f"**{r['speedup']:.2f}x**",
        ]
        for r in v["rows"]
    ]
    head = [
        "model",
        "layout",
        "mode",
        "global batch",
        "jaxdp samples/s",
        "torch_ref samples/s",
        "jaxdp / torch_ref",
    ]
    return _table(head, rows) + (
        f"\n\nThreads: XLA uses the process's {v['threads']} CPUs (its affinity); torch_ref "
        f"runs on {v['threads']} and on 1 thread (`set_num_threads`) and the faster counts; "
        f"DDP ranks get {v['threads']} / {v['num_devices']} each. Accumulation: "
        f"K={v['ga_accum_steps']} on 1 device; data parallel: {v['num_devices']} devices x "
        f"K={v['dp_accum_steps']}. {v['repeats']} repeats, medians; the accumulation speedup is "
        "the median of per-round ratios (the two timed in turns), the data-parallel one the "
        "ratio of medians (jaxdp timed before and after the torch ranks)."
    )


def _other_threads(r: dict[str, Any]) -> str:
    others = {int(k): v for k, v in r["torch_samples_per_second_by_threads"].items()}
    others.pop(r["torch_threads"])
    return ", ".join(f"{v:,.0f} ({k})" for k, v in others.items()) or "-"


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
            + _table(["path", "K", "all-reduces / step", "bytes / step", "/ gradient bytes"], rows)
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
    return _table(head, rows)


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
            + _table(
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


def gpu_section(g: dict[str, Any] | None) -> str:
    if g is None or g.get("tiny"):
        return (
            "_Pending a lent GPU: no GPU was available to the session that made this file. "
            "The script is ready: `bin/jaxdp bench --only gpu` (or "
            "`python benchmarks/gpu_gpt2.py --out benchmarks/results`) on a machine with "
            "jax[cuda] and torch._"
        )
    d = g["device"]
    rows = []
    for name in ("jaxdp", "torch"):
        if name in g:
            s = g[name]
            label = (
                "torch.compile"
                if s.get("compiled")
                else ("torch eager" if name == "torch" else "jaxdp fused")
            )
            rows.append(
                [
                    label,
                    f"{1e3 * s['step_seconds']:.1f}",
                    f"{s['tokens_per_second']:,.0f}",
                    f"**{100 * s['mfu']['6N+attention']:.1f}%**",
                    f"{100 * s['mfu']['6N']:.1f}%",
                ]
            )
    return (
        f"{d.get('torch_device') or d['jax_device']}; jax {d['jax']}, torch {d.get('torch')}, CUDA "
        f"{d.get('cuda')}. Measured bf16 matmul peak ({g['peak']['n']}^3 `jnp.dot`): "
        f"{g['peak']['flops_per_second'] / 1e12:.0f} TFLOP/s. {g['params']:,} parameters, "
        f"micro-batch {g['micro_batch_size']} x {g['config']['block_size']} tokens, K="
        f"{g['accum_steps']}: {g['tokens_per_step']:,} tokens per step.\n\n"
        + _table(["", "ms / step", "tokens/s", "MFU (6N + attention)", "MFU (6N)"], rows)
    )


# ---- targets ---------------------------------------------------------------------------------


def _verdict(value: float, bound: float, *, at_most: bool) -> str:
    ok = value <= bound if at_most else value >= bound
    if ok:
        return "met"
    return f"**missed** by {abs(value - bound) / bound:.0%} of the target"


def targets_section(r: dict[str, dict[str, Any]]) -> str:
    rows = []
    if "overhead" in r:
        worst = {
            m["model"]: max(
                (x for x in m["rows"] if x["path"] == "fused"), key=lambda x: x["ratio"]
            )
            for m in r["overhead"]["models"]
        }
        for model, x in worst.items():
            rows.append(
                [
                    f"fused step <= 1.05 x floor, K <= 16 ({model})",
                    f"worst {x['ratio']:.3f} (K={x['accum_steps']})",
                    _verdict(x["ratio"], 1.05, at_most=True),
                ]
            )
    if "vs_torch" in r:
        for x in r["vs_torch"]["rows"]:
            if x["mode"].startswith("accumulation") and x["model"] in ("mlp", "mlp-ref"):
                rows.append(
                    [
                        f"jaxdp >= 1.3 x torch_ref samples/s, 1-device accumulation ({x['model']})",
                        f"{x['speedup']:.2f}x",
                        _verdict(x["speedup"], 1.3, at_most=False),
                    ]
                )
    if "comms" in r:
        rows.append(_comms_target(r["comms"]))
    if "memory" in r:
        for m in r["memory"]["models"]:
            x = max(m["rows"], key=lambda x: x["temp_ratio"])
            rows.append(
                [
                    f"fused temporaries <= 1.1 x one micro-batch step, every K ({m['model']})",
                    f"worst {x['temp_ratio']:.3f} (K={x['accum_steps']})",
                    _verdict(x["temp_ratio"], 1.1, at_most=True),
                ]
            )
    g = r.get("gpu")
    if g and not g.get("tiny") and "torch" in g:
        mfu = g["jaxdp"]["mfu"]["6N+attention"]
        speed = g["jaxdp"]["tokens_per_second"] / g["torch"]["tokens_per_second"]
        rows.append(
            ["GPU: MFU >= 45% (124M, bf16)", f"{mfu:.1%}", _verdict(mfu, 0.45, at_most=False)]
        )
        rows.append(
            ["GPU: tokens/s >= torch.compile", f"{speed:.2f}x", _verdict(speed, 1.0, at_most=False)]
        )
    else:
        rows.append(["GPU: MFU >= 45%, tokens/s >= torch.compile", "pending a lent GPU", "-"])
    return _table(["target", "measured", "verdict"], rows)


def _comms_target(c: dict[str, Any]) -> list[str]:
    exact = naive = True
    for m in c["models"]:
        g = m["gradient_bytes"]
        for x in m["rows"]:
            if x["path"] == "naive":
                naive &= x["bytes_per_step"] == x["accum_steps"] * g
            else:
                exact &= x["bytes_per_step"] == g + 8 and x["executions_per_step"] == 1
    measured = (
        "fused and multisteps: 1 all-reduce of gradient bytes + 8 per step for every K"
        if exact
        else "fused/multisteps differ from gradient bytes + 8 for some K"
    ) + ("; naive: K x gradient bytes" if naive else "; naive: not K x")
    verdict = (
        "met (the 8 bytes: loss and weight sums riding along)" if exact and naive else "**missed**"
    )
    return ["all-reduce bytes per step == gradient bytes, every K, both paths", measured, verdict]


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
    }
    for name, build in builders.items():
        if name in r:
            s[name] = build(r[name]) + "\n\n" + _figure(name, out, markdown)
    if "comms" in r:
        s["ring"] = ring_section(r["comms"])
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

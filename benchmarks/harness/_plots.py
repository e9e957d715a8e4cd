"""The PNG figures of BENCHMARKS.md, drawn from the results JSON (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PATH_STYLE = {"fused": "o-", "multisteps": "s--", "naive": "x:"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


RATIO_STYLE = {
    "fused": ("o-", "fused / hand-written"),
    "hand-written streaming": ("d-.", "hand-written streaming / fused"),
    "multisteps": ("s--", "multisteps / fused"),
    "optax.MultiSteps": ("x:", "jit + optax.MultiSteps / fused"),
}


def overhead(result: dict[str, Any], path: Path) -> None:
    from ._targets import FUSED_TARGET, MULTISTEPS_TARGETS

    plt = _pyplot()
    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for name, (style, label) in RATIO_STYLE.items():
            rows = [r for r in model["rows"] if r["path"] == name]
            ks = [r["accum_steps"] for r in rows]
            ax.plot(ks, [r["compared"]["ratio"] for r in rows], style, label=label)
            lo = [min(r["compared"]["ratios"]) for r in rows]
            hi = [max(r["compared"]["ratios"]) for r in rows]
            ax.fill_between(ks, lo, hi, alpha=0.15)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(FUSED_TARGET, color="red", lw=0.8, ls="--", label=f"target {FUSED_TARGET}")
        bound = MULTISTEPS_TARGETS.get(model["model"])
        if bound is not None:
            ax.axhline(bound, color="purple", lw=0.8, ls=":", label=f"target {bound}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("accum_steps K")
        ax.set_ylabel("time per optimizer step, ratio")
        ax.set_title(f"{model['model']}: {model['describe']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("Accumulation overhead (median; band: min-max over repeats)", fontsize=10)
    _save(plt, fig, path)


def vs_torch(result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    labels = [f"{r['model']}\n{r['mode'].split(',')[0]}" for r in rows]
    x = range(len(rows))
    bars = (
        ("jaxdp", "jaxdp_samples_per_second", -0.27),
        ("hand-written", "hand_written_samples_per_second", 0.0),
        ("torch_ref", "torch_samples_per_second", 0.27),
    )
    for label, key, shift in bars:
        ax.bar([i + shift for i in x], [r.get(key, float("nan")) for r in rows], 0.27, label=label)
    for i, r in zip(x, rows, strict=True):
        ax.annotate(
            f"{r['speedup']:.2f}x",
            (i - 0.27, r["jaxdp_samples_per_second"]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("samples / s (median)")
    ax.set_title(
        f"jaxdp vs torch_ref on {result['threads']} CPU threads, separate processes "
        f"(data parallel: {result['num_devices']} emulated devices vs gloo ranks)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def comms(result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for model in result["models"]:
        for name in ("fused", "multisteps", "naive"):
            rows = [r for r in model["rows"] if r["path"] == name]
            left.plot(
                [r["accum_steps"] for r in rows],
                [r["ratio_to_gradient_bytes"] for r in rows],
                PATH_STYLE[name],
                label=f"{model['model']} {name}",
            )
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.set_xlabel("accum_steps K")
    left.set_ylabel("all-reduce bytes per step / gradient bytes")
    left.set_title(f"Per optimizer step, {result['num_devices']} devices", fontsize=9)
    left.legend(fontsize=7)
    for link in result["links"]:
        for model in {r["model"] for r in result["ring"]}:
            rows = [r for r in result["ring"] if r["link"] == link and r["model"] == model]
            style = "-" if link.startswith("NVLink") else "--"
            right.plot(
                [r["num_devices"] for r in rows],
                [1e3 * r["seconds"] for r in rows],
                style,
                marker="o",
                label=f"{model}, {link.split(' (')[0]}",
            )
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("GPUs N")
    right.set_ylabel("ms per all-reduce (ring, bandwidth term)")
    right.set_title("Ring model: 2(N-1)/N x bytes / bandwidth", fontsize=9)
    right.legend(fontsize=7)
    _save(plt, fig, path)


def memory(result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for model in result["models"]:
        ks = [r["accum_steps"] for r in model["rows"]]
        fused = [r["fused"]["temporaries"] / 1e6 for r in model["rows"]]
        single = [r["single_micro_batch"]["temporaries"] / 1e6 for r in model["rows"]]
        (line,) = left.plot(ks, fused, "o-", label=f"{model['model']} fused step, temporaries")
        left.plot(
            ks, single, "x:", color=line.get_color(), label=f"{model['model']} one micro-batch"
        )
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("accum_steps K (global batch fixed, micro-batch = per-device rows / K)")
    left.set_ylabel("MB per device (XLA)")
    left.set_title("Temporaries of the compiled step", fontsize=9)
    left.legend(fontsize=7)
    names = [m["model"] for m in result["models"]]
    without = [m["largest_without_accumulation"]["global_batch_size"] for m in result["models"]]
    with_accum = [m["largest_with_accumulation"]["global_batch_size"] for m in result["models"]]
    x = range(len(names))
    right.bar([i - 0.2 for i in x], without, 0.4, label="without accumulation (K=1)")
    right.bar([i + 0.2 for i in x], with_accum, 0.4, label="fused, micro-batch fixed, K grows")
    right.set_xticks(list(x), names)
    right.set_yscale("log")
    right.set_ylabel("largest global batch (rows)")
    right.set_title(f"Fits {result['budget'] / 2**20:.0f} MiB per device", fontsize=9)
    right.legend(fontsize=7)
    _save(plt, fig, path)


def loader(result: dict[str, Any], path: Path) -> None:
    from ._render_loader import loader_figure

    loader_figure(result, path)


def zero(result: dict[str, Any], path: Path) -> None:
    """Per model: step time / stage 0 (median and range of the rounds) and the state's
    per-device bytes by part, per variant."""
    plt = _pyplot()
    models = result["models"]
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 6.4), squeeze=False)
    parts = (("params_bytes", "parameters"), ("opt_state_bytes", "optimizer state"))
    parts += (("accumulator_bytes", "float32 accumulator"),)
    for i, model in enumerate(models):
        rows, top, bottom = model["rows"], axes[0][i], axes[1][i]
        names = [r["variant"] for r in rows]
        ratios = [r["compared"]["ratio"] for r in rows]
        low = [q - min(r["compared"]["ratios"]) for q, r in zip(ratios, rows, strict=True)]
        high = [max(r["compared"]["ratios"]) - q for q, r in zip(ratios, rows, strict=True)]
        top.bar(names, ratios, yerr=[low, high], capsize=3)
        top.axhline(result["target"]["at_most"], color="r", ls="--", lw=1, label="target")
        top.set_title(f"{model['model']}: step time / stage 0 (K={result['accum_steps']})")
        top.legend(fontsize=8)
        base = [0.0] * len(rows)
        for key, label in parts:
            values = [r[key] / 1e6 for r in rows]
            bottom.bar(names, values, bottom=base, label=label)
            base = [a + b for a, b in zip(base, values, strict=True)]
        bottom.set_title(f"per-device MB on {result['num_devices']} devices (XLA)")
        bottom.set_xlabel("ZeRO stage")
        bottom.legend(fontsize=8)
    _save(plt, fig, path)


FIGURES = {
    "overhead": overhead,
    "vs_torch": vs_torch,
    "comms": comms,
    "memory": memory,
    "loader": loader,
    "zero": zero,
}

"""A parity report as text (per step, per parameter, per parameter group) and as a plot."""

from __future__ import annotations

import os
from typing import Any

from ._runner import ParityReport, sizes_of

# At most this many parameter groups get a column (the ones that diverge most).
MAX_GROUPS = 8
# Where a zero difference sits on the log-scale plot.
PLOT_FLOOR = 1e-18


def _stage(c: Any) -> str:
    if c.zero_stage == 0:
        return ""
    groups = f", shards={c.shards}" if c.shards not in (None, c.num_devices) else ""
    return f" zero_stage={c.zero_stage}{groups}"


def _torch_side(c: Any) -> str:
    """The torch counterpart ParityConfig.zero_stage and shards choose (torch_config), or
    a recorded script."""
    if c.torch_side == "recorded":
        return "its torch script's record"
    if c.zero_stage == 3:
        if c.shards not in (None, c.num_devices):
            return f"torch_ref HSDP ({c.num_devices // c.shards} x {c.shards})"
        return "torch_ref FSDP2"
    ddp = "DDP" if c.num_devices > 1 else "GA"
    return f"torch_ref {ddp} + ZeroRedundancyOptimizer" if c.zero_stage else f"torch_ref {ddp}"


def format_parity(report: ParityReport) -> str:
    """A readable table: per step the worst parameter, then every parameter at its worst,
    then every step per parameter group, and the divergence locator's finding if it ran."""
    c = report.config
    lines = [
        f"parity: {c.model}, {_optimizer_name(c.optimizer)}, {c.dtype}, jaxdp "
        f"{c.path}/{c.strategy}{_stage(c)} vs {_torch_side(c)}; "
        f"batch {sizes_of(c).describe()}",
        f"tolerance: |jaxdp - torch| <= {report.atol:g} + {report.rtol:g} * |torch|",
        "",
        f"{'step':>4}  {'max abs':>10}  {'max rel':>10}  {'loss diff':>10}  worst parameter",
    ]
    for i, (abs_, rel) in enumerate(zip(report.max_abs, report.max_rel, strict=True)):
        worst = max(abs_, key=abs_.get)
        mark = "  <- first beyond tolerance" if report.first_failure == i + 1 else ""
        lines.append(
            f"{i + 1:>4}  {abs_[worst]:10.2e}  {max(rel.values()):10.2e}  "
            f"{report.loss_diff[i]:10.2e}  {worst}{mark}"
        )
    width = max(28, *(len(name) for name in report.max_abs[0]))
    lines += ["", f"{'parameter':<{width}} {'max abs':>10}  {'max rel':>10}  (over all steps)"]
    for name in report.max_abs[0]:
        a = max(step[name] for step in report.max_abs)
        r = max(step[name] for step in report.max_rel)
        lines.append(f"{name:<{width}} {a:10.2e}  {r:10.2e}")
    lines += ["", *group_table(report)]
    if report.divergence is not None:
        lines += ["", report.divergence.describe()]
    verdict = (
        "PASS: every step within tolerance"
        if report.passed
        else f"FAIL: step {report.first_failure} is the first beyond tolerance"
    )
    return "\n".join([*lines, "", verdict])


def group_rel(report: ParityReport) -> dict[str, list[float]]:
    """Per parameter group (the first name of each path), the max relative difference of
    every step; the groups that diverge most first, at most ``MAX_GROUPS``."""
    groups: dict[str, list[float]] = {}
    for name in report.max_rel[0]:
        group = name.split(".")[0]
        steps = [step[name] for step in report.max_rel]
        old = groups.get(group, [0.0] * len(steps))
        groups[group] = [max(a, b) for a, b in zip(old, steps, strict=True)]
    ranked = sorted(groups, key=lambda g: -max(groups[g]))[:MAX_GROUPS]
    return {g: groups[g] for g in ranked}


def group_table(report: ParityReport) -> list[str]:
    """The whole trajectory: max relative difference per step and parameter group."""
    groups = group_rel(report)
    width = max(9, *(len(g) for g in groups))
    lines = [
        "max relative difference per step and parameter group:",
        f"{'step':>4}  " + "  ".join(f"{g:>{width}}" for g in groups),
    ]
    for i in range(len(report.max_rel)):
        lines.append(f"{i + 1:>4}  " + "  ".join(f"{v[i]:>{width}.2e}" for v in groups.values()))
    return lines


def plot_parity(report: ParityReport, path: str | os.PathLike) -> None:
    """Writes a PNG: the max relative difference per step (log scale), one line per
    parameter group, with the relative tolerance and the first step beyond it.

    Needs matplotlib (``pip install 'jaxdp[cli]'``); uses its object API, no pyplot state.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    steps = range(1, len(report.max_rel) + 1)
    for group, values in group_rel(report).items():
        ax.plot(steps, [max(v, PLOT_FLOOR) for v in values], marker="o", ms=3, label=group)
    ax.axhline(report.rtol, color="black", ls="--", lw=1, label=f"rtol {report.rtol:g}")
    if report.first_failure is not None:
        ax.axvline(report.first_failure, color="red", lw=1, label="first beyond tolerance")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("max |jaxdp - torch| / |torch|")
    ax.set_title(f"parity: {report.config.model} ({report.config.dtype})", fontsize=10)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def _optimizer_name(optimizer: Any) -> str:
    if isinstance(optimizer, str):
        return optimizer
    groups = f" ({len(optimizer.groups) + 1} parameter groups)" if optimizer.groups else ""
    return f"{optimizer.name}{groups}"

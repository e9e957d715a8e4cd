"""The targets table of BENCHMARKS.md: each target, its measured figure and the verdict."""

from __future__ import annotations

from typing import Any

from ._common import markdown_table
from ._render_loader import loader_targets


def _verdict(value: float, bound: float, *, at_most: bool) -> str:
    ok = value <= bound if at_most else value >= bound
    if ok:
        return "met"
    return f"**missed** by {abs(value - bound) / bound:.0%} of the target"


def targets_section(r: dict[str, dict[str, Any]]) -> str:
    rows = []
    if "overhead" in r:
        rows += _overhead_targets(r["overhead"])
    if "vs_torch" in r:
        for x in r["vs_torch"]["rows"]:
            bound = TORCH_TARGETS.get(x["model"])
            if x["mode"].startswith("accumulation") and bound is not None:
                rows.append(
                    [
                        f"jaxdp fused >= {bound} x torch_ref samples/s, 1-device accumulation, "
                        f"separate processes ({x['model']})",
                        f"{x['speedup']:.2f}x",
                        _verdict(x["speedup"], bound, at_most=False),
                    ]
                )
    if "comms" in r:
        rows.append(_comms_target(r["comms"]))
    if "loader" in r:
        rows += loader_targets(r["loader"])
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
    if "zero" in r:
        rows += _zero_targets(r["zero"])
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
    return markdown_table(["target", "measured", "verdict"], rows)


# jaxdp fused over torch_ref's loop, at least (issue 15 for mlp and gpt, issue 6 for mlp-ref).
TORCH_TARGETS = {"mlp-ref": 1.3, "mlp": 1.3, "gpt": 1.0}
# Per model, the multisteps step over the fused one, at most (issue 15).
MULTISTEPS_TARGETS = {"mlp": 1.15, "gpt": 1.05}
FUSED_TARGET, FUSED_KS = 1.10, (1, 4, 16)  # fused over the hand-written step, at most


def _overhead_targets(o: dict[str, Any]) -> list[list[str]]:
    rows = []
    for m in o["models"]:
        fused = [x for x in m["rows"] if x["path"] == "fused" and x["accum_steps"] in FUSED_KS]
        if fused:
            x = max(fused, key=lambda x: x["compared"]["ratio"])
            ks = ", ".join(str(k) for k in FUSED_KS)
            rows.append(
                [
                    f"fused step <= {FUSED_TARGET} x hand-written step, K in {{{ks}}} "
                    f"({m['model']})",
                    f"worst {x['compared']['ratio']:.3f} (K={x['accum_steps']})",
                    _verdict(x["compared"]["ratio"], FUSED_TARGET, at_most=True),
                ]
            )
        bound = MULTISTEPS_TARGETS.get(m["model"])
        multi = [x for x in m["rows"] if x["path"] == "multisteps"]
        if bound is not None and multi:
            x = max(multi, key=lambda x: x["compared"]["ratio"])
            floor = [
                y["compared"]["ratio"]
                for y in m["rows"]
                if y["path"] == "hand-written streaming" and y["accum_steps"] == x["accum_steps"]
            ]
            there = f"; the hand-written streaming step {floor[0]:.3f} there" if floor else ""
            rows.append(
                [
                    f"multisteps step <= {bound} x fused step, every K ({m['model']})",
                    f"worst {x['compared']['ratio']:.3f} (K={x['accum_steps']}){there}",
                    _verdict(x["compared"]["ratio"], bound, at_most=True),
                ]
            )
    return rows


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


def _zero_targets(z: dict[str, Any]) -> list[list[str]]:
    """Issue 14: stage 1's step time against stage 0's (acceptance 5), and the optimizer
    state (stage 1) and accumulator (stage 2) per device against 1/N of stage 0's."""
    t, n, rows = z["target"], z["num_devices"], []
    for m in z["models"]:
        by = {x["variant"]: x for x in m["rows"]}
        ratio = by[t["variant"]]["compared"]["ratio"]
        rows.append(
            [
                f"ZeRO stage {t['variant']} step <= {t['at_most']} x stage {t['of']}, {n} emulated "
                f"CPU devices, K={z['accum_steps']} ({m['model']})",
                f"{ratio:.3f}x",
                _verdict(ratio, t["at_most"], at_most=True),
            ]
        )
        for variant, key, label in (
            ("1", "opt_state_bytes", "optimizer state"),
            ("2", "accumulator_bytes", "float32 accumulator"),
        ):
            share = by[variant][key] / by["0"][key]
            rows.append(
                [
                    f"ZeRO stage {variant} {label} per device <= 1/{n} of stage 0 plus leaves "
                    f"kept whole (XLA, {m['model']})",
                    f"{share:.4f} of stage 0",
                    "met" if share <= 1 / n + 0.01 else "**over 1/N by more than 1%**",
                ]
            )
    return rows

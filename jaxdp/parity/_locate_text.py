"""What the divergence locator found, and how it reads."""

from __future__ import annotations

import dataclasses
from typing import Any

# How close a loss ratio must be to accum_steps (or its inverse) to be named as such.
RATIO_RTOL = 1e-6


@dataclasses.dataclass(frozen=True)
class StageDiff:
    """One stage of one optimizer step, compared: per name (a parameter, or an output or
    loss of a micro-batch) the largest absolute and relative difference, and the names
    beyond tolerance, worst first."""

    stage: str
    max_abs: dict[str, float]
    max_rel: dict[str, float]
    beyond: list[str]
    step: int | None = None  # the optimizer update: the replayed step compared

    @property
    def passed(self) -> bool:
        return not self.beyond


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where a port first departs from torch: the divergence locator's finding.

    From torch's weights before optimizer ``step`` (1-based) both sides run the
    step's stages in order: ``"forward"`` (each micro-batch's outputs, then every
    submodule's output against its input), ``"loss"``, ``"micro-batch gradients"``,
    ``"accumulated gradients"`` (jaxdp's all-reduced gradient against DDP's) and
    ``"optimizer update"`` (both optimizers replayed from step 1 on torch's
    gradients). ``stage`` is the first beyond tolerance (None: none is) and
    ``names`` what differs there, worst first: JAX parameter paths (for
    ``"forward"``, the parameters of ``module``, the innermost submodule whose
    output differs from the same input); ``stages`` holds every stage compared
    (the locator stops after the first that differs) and ``notes`` the reading.
    """

    step: int
    stage: str | None
    names: list[str]
    module: str | None
    stages: list[StageDiff]
    notes: list[str]

    def describe(self) -> str:
        """The finding as text: one line per stage, then the notes."""
        lines = [f"divergence locator: optimizer step {self.step}, from torch's weights before it"]
        for s in self.stages:
            worst = max(s.max_rel, key=s.max_rel.get) if s.max_rel else "-"
            verdict = f"DIFFERS ({len(s.beyond)} beyond tolerance)" if s.beyond else "agrees"
            at = f" (step {s.step})" if s.step is not None else ""
            lines.append(
                f"  {s.stage + at:<30} max abs {max(s.max_abs.values(), default=0):9.2e}  "
                f"max rel {max(s.max_rel.values(), default=0):9.2e}  {verdict}; worst {worst}"
            )
        return "\n".join([*lines, *self.notes])


def notes_for(
    first: StageDiff | None,
    module: str | None,
    names: list[str],
    trace: list[str],
    ratio: float,
    port: Any,
) -> list[str]:
    """The locator's reading of its first differing stage."""
    k = port.config.accum_steps
    if first is None:
        return [
            "every stage agrees from torch's weights at this step: the difference builds up "
            "from rounding over the steps before, or lives in state the stages do not "
            "compare (BatchNorm statistics, optimizer state the replay does not reach)"
        ]
    listed = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
    if first.stage == "forward":
        return [*_forward_notes(module, listed, trace), *trace]
    if first.stage == "loss":
        line = f"first difference: loss; the outputs agree, jaxdp / torch = {ratio:.6g}"
        if abs(ratio - k) <= RATIO_RTOL * k and k > 1:
            line += (
                f" = accum_steps ({k}): the JAX loss sums the window (a missing `loss / "
                "accum_steps`); jaxdp averages the window itself, give one micro-batch's mean"
            )
        elif abs(ratio * k - 1) <= RATIO_RTOL and k > 1:
            line += (
                f" = 1 / accum_steps ({k}): a `loss / accum_steps` in the JAX loss; jaxdp "
                "averages the window itself"
            )
        return [line]
    if first.stage == "micro-batch gradients":
        return [
            "first difference: gradients of a micro-batch, with outputs and loss agreeing: "
            "a custom gradient, a stop_gradient or detach, or an op differentiated "
            f"differently; parameters: {listed}"
        ]
    if first.stage == "accumulated gradients":
        return [
            "first difference: the accumulated gradient, with every micro-batch's agreeing: "
            "the data order, the micro-batch weights or the loss normalization "
            f"(loss_reduction) differ; parameters: {listed}"
        ]
    return [
        f"first difference: the optimizer update at step {first.step}, with the gradients "
        f"agreeing: the JAX optimizer is not torch's {port.spec} (clipping: torch's "
        "clip_grad_norm_ divides by norm + 1e-6, see clip_grad_norm_like_torch; weight "
        f"decay order; eps placement, eps_root=0); parameters: {listed}"
    ]


def _forward_notes(module: str | None, listed: str, trace: list[str]) -> list[str]:
    if module is None:
        return [
            "first difference: forward, in no single submodule that torch and the port both "
            "have (compared below by path, NCHW against NHWC where shapes say so)",
            "modules (torch's order; inputs and outputs against torch):",
        ]
    where = module or "the model itself"
    children = any(line.lstrip().startswith(f"{module}.") for line in trace) or module == ""
    reading = (
        "its submodules agree given their own inputs: the difference is in its own code "
        "between them (an activation, a reshape, a constant)"
        if children
        else "look at its settings (epsilon, an approximation, a layout, its dtype)"
    )
    lines = [
        f"first difference: forward, in {where}: the same input gives a different output; {reading}"
    ]
    if listed:
        lines.append(f"its parameters: {listed}")
    return [*lines, "modules (torch's order; inputs and outputs against torch):"]

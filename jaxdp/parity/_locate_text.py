"""What the divergence locator found, and how it reads."""

from __future__ import annotations

import dataclasses
from typing import Any

# How closely a pattern must hold to be named (a loss ratio of accum_steps, an update that is
# torch's times one factor, a difference that is torch's weight decay): far looser than
# float64's tolerance, far tighter than a coincidence.
READING_RTOL = 1e-6


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

    From torch's weights before optimizer ``step`` (1-based) both sides compute the
    step's quantities in its order: ``"forward"`` (each micro-batch's outputs, then
    every submodule's output against its input), ``"loss"`` (each micro-batch's term
    of the step's loss: its loss times its share, ``1 / (accum_steps * num_devices)``
    of a mean or ``1 / count`` of a token-weighted sum; and the counts),
    ``"micro-batch gradients"``, ``"accumulated gradients"`` (jaxdp's all-reduced
    gradient against DDP's), then, both optimizers replayed from step 1 on torch's
    gradients at torch's weights, ``"learning rate"`` (when the port's can be read:
    the schedule ``compare_models`` built its optimizer with, or an
    ``optax.inject_hyperparams`` state), ``"optimizer moments"`` (torch's
    ``exp_avg``, ``exp_avg_sq`` or ``momentum_buffer`` against optax's Adam ``mu``,
    ``nu`` or trace) and ``"optimizer update"`` (the new weights). ``stage`` is the
    first beyond tolerance (None: none is) and ``names`` what differs there, worst
    first: JAX parameter paths (for ``"forward"``, the parameters of ``module``, the
    innermost submodule whose output differs from the same input); ``stages`` holds
    every stage compared (the locator stops after the first that differs), ``kind``
    what that pattern means and ``notes`` the reading.

    Kinds: ``"forward"`` (a layer's settings or a block's code), ``"loss"`` (the loss
    or its normalization: it differs from the first micro-batch on), ``"gradient"``
    (a micro-batch's gradient with its loss agreeing: a custom gradient, a
    ``stop_gradient``), ``"accumulation"`` (every micro-batch agrees, their sum does
    not: the data order or the micro-batch weights), ``"schedule"`` (the learning
    rate alone differs, or every leaf's update is torch's times one factor),
    ``"optimizer moments"`` (the gradient reaches the moments otherwise: the clip,
    the betas, the decay's order), ``"weight decay or mask"`` (one group of leaves'
    update differs, the rest agree) and ``"optimizer formula"`` (gradients, rate and
    moments agree, every leaf's update differs: eps's place, the bias correction);
    None when every stage agrees.
    """

    step: int
    stage: str | None
    names: list[str]
    module: str | None
    stages: list[StageDiff]
    notes: list[str]
    kind: str | None = None

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
        kind = [f"kind: {self.kind}"] if self.kind else []
        return "\n".join([*lines, *kind, *self.notes])


def notes_for(
    first: StageDiff | None,
    module: str | None,
    names: list[str],
    trace: list[str],
    ratio: float,
    port: Any,
    detail: list[str],
    update_kind: str = "optimizer formula",
    rate_read: bool = False,
) -> tuple[str | None, list[str]]:
    """The locator's reading of its first differing stage: its kind (see
    :class:`Divergence`) and notes; ``detail``, what the locator found in that stage's
    numbers (a loss's normalization, an update's pattern), ``update_kind`` the kind
    an update's pattern shows and ``rate_read`` whether the port's learning rate was
    compared."""
    k = port.config.accum_steps
    if first is None:
        return None, [
            "every stage agrees from torch's weights at this step: the difference builds up "
            "from rounding over the steps before, or lives in state the stages do not "
            "compare (BatchNorm statistics, optimizer state the replay does not reach)"
        ]
    listed = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
    at = f" at step {first.step}" if first.step is not None else ""
    if first.stage == "forward":
        return "forward", [*_forward_notes(module, listed, trace), *trace]
    if first.stage == "loss":
        line = (
            "first difference: the loss (each micro-batch's term of the step's loss), with "
            f"the outputs agreeing, jaxdp / torch = {ratio:.6g}"
        )
        if abs(ratio - k) <= READING_RTOL * k and k > 1:
            line += (
                f" = accum_steps ({k}): the JAX loss sums the window (a missing `loss / "
                "accum_steps`); jaxdp averages the window itself, give one micro-batch's mean"
            )
        elif abs(ratio * k - 1) <= READING_RTOL and k > 1:
            line += (
                f" = 1 / accum_steps ({k}): a `loss / accum_steps` in the JAX loss; jaxdp "
                "averages the window itself"
            )
        return "loss", [line + ": the loss or its normalization", *detail]
    if first.stage == "micro-batch gradients":
        return "gradient", [
            "first difference: gradients of a micro-batch, with outputs and loss agreeing: "
            "a custom gradient, a stop_gradient or detach, or an op differentiated "
            f"differently; parameters: {listed}"
        ]
    if first.stage == "accumulated gradients":
        return "accumulation", [
            "first difference: the accumulated gradient, with every micro-batch's agreeing: "
            "the data order, the micro-batch weights or the loss normalization "
            f"(loss_reduction) differ; parameters: {listed}"
        ]
    if first.stage == "learning rate":
        lr = list(first.max_abs)[0]
        return "schedule", [
            f"first difference: the learning rate{at}, with the gradients agreeing "
            f"(|jaxdp - torch| = {first.max_abs[lr]:.3g}, relative {first.max_rel[lr]:.3g}): "
            "the schedule; optax reads it at the count of updates before this one, a torch "
            "scheduler stepped after optimizer.step() gives step i the factor f(i): an "
            "optax schedule of f(count + 1) is a step ahead"
        ]
    if first.stage == "optimizer moments":
        return "optimizer moments", [
            f"first difference: the optimizer's moments{at}, with the gradients and the "
            "learning rate agreeing: the gradient reaches them otherwise (the clip: torch's "
            "clip_grad_norm_ divides by norm + 1e-6, see clip_grad_norm_like_torch; the "
            f"betas; weight decay before momentum in SGD); parameters: {listed}"
        ]
    agreeing = (
        "the gradients, the learning rate and the moments"
        if rate_read
        else (
            "the gradients and the moments (the port's own optax optimizer: its learning rate "
            "is not read)"
        )
    )
    line = _UPDATE[update_kind].format(at=at, spec=port.spec, listed=listed, agreeing=agreeing)
    return update_kind, [line, *detail]


# The first line of an update that differs, by what its numbers show (the locator's reading).
_UPDATE = {
    "schedule": (
        "first difference: the update{at}, every leaf's by one factor, with {agreeing} "
        "agreeing: the learning rate (the schedule), or a gradient scaled otherwise"
    ),
    "weight decay or mask": (
        "first difference: the update{at} of one group of leaves, the others agreeing, with "
        "{agreeing} agreeing: weight decay or a mask "
        "(optax's mask=, torch's parameter groups); parameters: {listed}"
    ),
    "optimizer formula": (
        "first difference: the update{at}, with {agreeing} agreeing: the optimizer's "
        "formula is not torch's {spec} (eps placement: "
        "torch adds eps outside the square root, optax's eps_root=0; the bias correction; "
        "the clip: torch's clip_grad_norm_ divides by norm + 1e-6, see "
        "clip_grad_norm_like_torch); parameters: {listed}"
    ),
}


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

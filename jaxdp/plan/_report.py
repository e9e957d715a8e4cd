"""The text ``jaxdp plan`` prints for a :class:`MemoryPlan` (and XLA's figures)."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

from .._stages import STAGE_LAYOUTS, stage_layout
from ._memory import (
    ACCUM_BYTES,
    DTYPE_POLICIES,
    GATHER_DTYPES,
    OPTIMIZER_MOMENTS,
    MemoryPlan,
    smallest_fit,
)


@dataclasses.dataclass(frozen=True)
class XlaFigures:
    """XLA's side of a plan for a model jaxdp compiled (see ``jaxdp.plan._xla``)."""

    platform: str
    compiled_devices: int
    micro_batch_size: int | None  # XLA's choice; None: nothing fits
    accum_steps: int | None
    memory: Any  # CompiledMemory of the chosen split (or the smallest tried)
    allreduce_bytes: int | None  # summed over the compiled step's all-reduces
    compiles: int


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units (GB = 10^9 bytes)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def report(
    plan: MemoryPlan,
    *,
    model: str | None = None,
    xla: XlaFigures | None = None,
    note: str | None = None,
    batch_note: str | None = None,
) -> str:
    """The whole report: header, per-device table, verdict, batch split, XLA, all-reduce.

    ``batch_note`` is a line about the global batch size, put under the header.
    """
    header = _header(plan, model) + (f"\n{batch_note}" if batch_note else "")
    sections = [header, _table(plan), _verdict(plan)]
    if xla is not None:
        sections.append(_xla(plan, xla))
    if note:
        sections.append(note)
    sections.append(_allreduce(plan, xla))
    return "\n\n".join(_wrap(section) for section in sections)


def _wrap(text: str) -> str:
    return "\n".join(
        textwrap.fill(line, 100, subsequent_indent="  ", break_on_hyphens=False)
        if len(line) > 100
        else line
        for line in text.splitlines()
    )


def _header(plan: MemoryPlan, model: str | None) -> str:
    policy = DTYPE_POLICIES[plan.policy]
    moments = OPTIMIZER_MOMENTS[plan.optimizer]
    what = f"{model}, {plan.params:,} parameters" if model else f"{plan.params:,} parameters"
    per_param = policy.weights + policy.gradients + policy.master + moments * policy.moment
    if plan.device_memory is None or plan.usable is None:
        devices = f"{plan.num_devices} device(s), memory per device not given"
    else:
        devices = (
            f"{plan.num_devices} device(s) of {format_bytes(plan.device_memory)}, "
            f"{plan.headroom:.0%} kept free: {format_bytes(plan.usable)} usable per device"
        )
    return "\n".join(
        [
            f"jaxdp plan: {what}, policy {plan.policy}, optimizer {plan.optimizer}",
            devices,
            f"bytes per parameter, {plan.policy} ({policy.description}):",
            f"  weights {policy.weights} + gradients {policy.gradients} + master weights "
            f"{policy.master} + optimizer state {moments} x {policy.moment} = {per_param}, "
            f"and jaxdp's fp32 gradient accumulator {ACCUM_BYTES}",
            *_zero_line(plan),
        ]
    )


def _zero_line(plan: MemoryPlan) -> list[str]:
    layout = stage_layout(plan.zero_stage)
    if not layout.state_split:
        return []
    split = "master weights and optimizer state"
    if layout.window_split:
        split = "master weights, optimizer state and gradient accumulator"
    if not layout.params_split:
        return [
            f"zero_stage={plan.zero_stage}: {split} split over the {plan.num_devices} device(s)"
        ]
    s, n = plan.split_over, plan.num_devices
    where = f"the {n} device(s)"
    if s != n:
        where = f"the {s} devices of each of {n // s} shard groups (HSDP, --shards {s})"
    policy, moments = DTYPE_POLICIES[plan.policy], OPTIMIZER_MOMENTS[plan.optimizer]
    rest, gather = _rest_dtype(plan), _short(plan.gather_dtype)
    copy = "master weights" if policy.master else "weights"
    resting = (policy.master or policy.weights) + moments * policy.moment
    stack = f"{plan.params - plan.root_params:,} parameters in a stack of "
    stack += f"{plan.layers} layers" if plan.layers else "layers (--layers not given)"
    return [
        f"zero_stage=3: parameters, optimizer state and gradient accumulator split over {where}",
        f"  at rest per parameter: {rest} {copy} {policy.master or policy.weights} + optimizer "
        f"state {moments} x {policy.moment} = {resting}, over {s}; no other copy of the weights "
        f"rests: they are gathered in {gather} ({GATHER_DTYPES[plan.gather_dtype]}) while a "
        f"micro-batch runs, and its gradients come back in {rest} "
        f"({policy.master or policy.weights})",
        f"  {stack} gathered one layer at a time (jaxdp.scan_layers), {plan.root_params:,} "
        "outside it (--root-params) gathered whole per micro-batch; every leaf split, "
        + (
            f"those no device count divides padded: {plan.padded_params:,} parameters at rest"
            if plan.padded_params is not None
            else "those no device count divides padded (not counted without --model)"
        ),
    ]


def _short(dtype: str | None) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype or "", "?")


def _rest_dtype(plan: MemoryPlan) -> str:
    """The dtype stage 3's split parameters rest in: the master's, else the weights'."""
    policy = DTYPE_POLICIES[plan.policy]
    return "fp32" if policy.master or policy.weights == 4 else "bf16"


def _table(plan: MemoryPlan) -> str:
    moments = OPTIMIZER_MOMENTS[plan.optimizer]
    rows = [
        ("weights", plan.weights),
        ("gradients", plan.gradients),
        ("master weights", plan.master),
        (f"optimizer state ({moments} moment(s))", plan.optimizer_state),
        ("= training state", plan.state),
        ("gradient accumulator (fp32)", plan.accumulator),
    ]
    layout = stage_layout(plan.zero_stage)
    if layout.state_split:
        n = plan.num_devices
        rows[2] = (f"master weights (1/{n})", plan.master)
        rows[3] = (f"optimizer state ({moments} moment(s), 1/{n})", plan.optimizer_state)
        if layout.window_split:
            rows[5] = (f"gradient accumulator (fp32, 1/{n})", plan.accumulator)
    if layout.params_split:
        rows = _stage_3_rows(plan)
    rows += _batch_rows(plan) if plan.device_memory is None else _fitted_rows(plan)
    lines = ["per device (estimate):"]
    width = max(34, *(len(name) for name, _ in rows))  # 1/N with N of 10 or more: 35
    for name, value in rows:
        shown = "unknown (give --activation-bytes-per-sample)" if value is None else value
        if not isinstance(shown, str):
            shown = format_bytes(shown)
        lines.append(f"  {name:<{width}} {shown:>12}")
    return "\n".join(lines)


def _stage_3_rows(plan: MemoryPlan) -> list[tuple[str, float | str | None]]:
    """What a stage-3 step holds: the split parameters and optimizer state at rest (the
    step's arguments but the batch), then what a micro-batch adds."""
    s, rest, gather = plan.split_over, _rest_dtype(plan), _short(plan.gather_dtype)
    moments = OPTIMIZER_MOMENTS[plan.optimizer]
    rows: list[tuple[str, float | str | None]] = []
    if plan.weights:
        rows.append((f"weights ({rest}, 1/{s})", plan.weights))
    if plan.master:
        rows.append((f"master weights (fp32, 1/{s})", plan.master))
    rows += [
        (f"optimizer state ({moments} moment(s), 1/{s})", plan.optimizer_state),
        ("= training state at rest", plan.resting),
        (f"gradient accumulator (fp32, 1/{s})", plan.accumulator),
        (f"gradients ({rest}, 1/{s})", plan.gradients),
    ]
    if plan.gathered_layer is None:
        rows.append(("gathered layer", "unknown (give --layers)"))
    else:
        rows.append((f"gathered layer (1 of {plan.layers}, {gather})", plan.gathered_layer))
        rows.append((f"  its gradient ({rest})", plan.layer_gradient))
    rows.append((f"root group gathered whole ({gather})", plan.root_group))
    rows.append((f"  its gradient ({rest})", plan.root_gradient))
    return rows


def _fitted_rows(plan: MemoryPlan) -> list[tuple[str, float | None]]:
    """The batch's rows at the chosen split, and the device's memory."""
    assert plan.device_memory is not None
    rows: list[tuple[str, float | None]] = []
    if plan.activation_bytes_per_sample is None:
        rows.append(("activations", None))
    elif plan.micro_batch_size:
        k, b = plan.accum_steps, plan.micro_batch_size
        rows.append((f"batch inputs ({k} x {b} rows)", plan.inputs))
        kept = f", remat {plan.remat}" if plan.remat else ""
        rows.append((f"activations ({b} samples{kept})", plan.activations))
    return rows + [
        ("total" if plan.micro_batch_size else "total before activations", plan.total),
        (f"headroom kept free ({plan.headroom:.0%})", plan.device_memory * plan.headroom),
        ("device memory", plan.device_memory),
    ]


def _batch_rows(plan: MemoryPlan) -> list[tuple[str, float | None]]:
    """Without a device size: the batch's bytes per sample, and the totals of the
    extreme splits of the per-device batch (one sample per micro-batch, or one micro-batch)."""
    act, inputs = plan.activation_bytes_per_sample, plan.input_bytes_per_sample
    if act is None:
        return [("activations", None), ("total before activations", plan.fixed)]
    kept = f" (remat {plan.remat})" if plan.remat else ""
    rows: list[tuple[str, float | None]] = [(f"activations per sample{kept}", act)]
    if inputs:
        rows.append(("batch inputs per sample", inputs))
    rows.append(("total before the batch", plan.fixed))
    if plan.global_batch_size is not None:
        rows_per_device = plan.global_batch_size // plan.num_devices
        held = plan.fixed + rows_per_device * inputs
        rows.append((f"total, {rows_per_device} micro-batch(es) of 1", held + act))
        if rows_per_device > 1:
            rows.append(
                (f"total, 1 micro-batch of {rows_per_device}", held + rows_per_device * act)
            )
    return rows


def _verdict(plan: MemoryPlan) -> str:
    state, fixed, usable = plan.state, plan.fixed, plan.usable
    if plan.device_memory is None or usable is None:
        return (
            "Not decided without --device-memory: whether this fits, and the largest "
            "micro-batch that does."
        )
    if not plan.fits_state:
        if state > plan.device_memory:
            first = (
                f"DOES NOT FIT: the training state alone needs {format_bytes(state)} per "
                f"device, more than the {format_bytes(plan.device_memory)} one device has."
            )
        else:
            first = (
                f"DOES NOT FIT: training state and accumulator need {format_bytes(fixed)} "
                f"per device, more than the {format_bytes(usable)} usable."
            )
        return f"{first}\n{_what_fits(plan)}"
    if plan.activation_bytes_per_sample is None:
        return (
            f"The state fits: {format_bytes(fixed)} of {format_bytes(usable)} usable. "
            "Give --activation-bytes-per-sample (or --model) to size the micro-batch."
        )
    if plan.micro_batch_size is None:
        return (
            f"DOES NOT FIT: the state fits ({format_bytes(fixed)} of {format_bytes(usable)}), "
            "but not the batch inputs with the activations of even one sample."
        )
    largest, chosen = plan.max_micro_batch_size, plan.micro_batch_size
    per_device = plan.accum_steps * chosen
    if largest == chosen:
        limit = "the largest that fits"
    elif plan.accum_steps == 1:
        limit = f"up to {largest:,} would fit; the target needs {chosen}"
    else:
        limit = f"{largest:,} would fit; {chosen} is the largest divisor of {per_device} rows"
    return (
        f"FITS: micro-batch of {chosen} samples per device ({limit}).\n"
        f"batch: {_identity(plan, plan.accum_steps, chosen)}; "
        f"{format_bytes(plan.total)} of {format_bytes(usable)} usable."
    )


def _what_fits(plan: MemoryPlan) -> str:
    """Where state and accumulator fit: the fewest devices per ZeRO stage, or the device
    size data parallelism without sharding needs."""
    fewest = smallest_fit(plan)
    lines = []
    if not stage_layout(plan.zero_stage).state_split:
        lines.append(
            "Data parallelism keeps a full copy on every device, so more devices do not help "
            f"at zero_stage=0: it needs devices of at least "
            f"{format_bytes(plan.fixed / (1 - plan.headroom))} (before activations), a leaner "
            "policy or optimizer (bf16, sgd), or the state split over the devices:"
        )
    else:
        lines.append(f"Not on {plan.num_devices} device(s) at zero_stage={plan.zero_stage}:")
    for layout in STAGE_LAYOUTS:
        if not layout.state_split:  # the same on any device count
            continue
        n = fewest[layout.zero_stage]
        where = f"on {n} device(s) or more" if n else "on no device count up to 4096"
        what = "state and accumulator"
        if layout.params_split:
            what = (
                "state, accumulator, gathered layer, root group and their gradients"
                if plan.gathered_layer is not None
                else "state and accumulator (before the gathered layer: give --layers)"
            )
        lines.append(f"  --zero-stage {layout.zero_stage}: {what} fit {where}")
    return "\n".join(lines)


def _identity(plan: MemoryPlan, accum_steps: int, micro_batch_size: int) -> str:
    n = plan.num_devices
    return (
        f"global_batch_size={n * accum_steps * micro_batch_size} = num_devices={n} x "
        f"accum_steps={accum_steps} x micro_batch_size={micro_batch_size}"
    )


def _xla(plan: MemoryPlan, xla: XlaFigures) -> str:
    m = xla.memory
    lines = [
        f"XLA's memory analysis (jaxdp's fused step compiled for {xla.compiled_devices} "
        f"{xla.platform} device(s), {xla.compiles} compiles); it decides:"
    ]
    if xla.micro_batch_size is None:
        lines.append(
            f"  DOES NOT FIT: even micro_batch_size=1 needs {format_bytes(m.total)} "
            f"of {format_bytes(plan.usable)} usable."
        )
        return "\n".join(lines)
    k, b = xla.accum_steps, xla.micro_batch_size
    lines.append(f"  FITS: batch: {_identity(plan, k, b)}")
    inputs = k * b * plan.input_bytes_per_sample
    estimate_args = plan.resting + inputs
    activations = b * (plan.activation_bytes_per_sample or 0.0)
    estimate_temps = plan.gradients + plan.accumulator + activations
    rows = [
        ("arguments: weights, optimizer state, batch", estimate_args, m.arguments),
        ("temporaries: gradients, accumulator, activations", estimate_temps, m.temporaries),
        ("outputs not aliased to arguments", 0.0, m.outputs - m.aliased),
        ("total", estimate_args + estimate_temps, m.total),
    ]
    lines.append(f"  {'at this split, per device':<50} {'estimate':>11} {'XLA':>11}  est/XLA")
    for name, est, actual in rows:
        ratio = f"{est / actual:.2f}" if actual and est else "-"
        lines.append(f"  {name:<50} {format_bytes(est):>11} {format_bytes(actual):>11}  {ratio}")
    return "\n".join(lines)


def _allreduce(plan: MemoryPlan, xla: XlaFigures | None) -> str:
    n = plan.num_devices
    wire = "bf16" if plan.allreduce_bytes < plan.params * ACCUM_BYTES else "fp32"
    per_param = int(plan.allreduce_bytes // plan.params)
    sums = f"{wire} gradient sums, {per_param} bytes/parameter"
    layout = stage_layout(plan.zero_stage)
    if layout.params_split:
        k = plan.accum_steps
        times = f"{k} per optimizer step" if k else "accum_steps not sized: counted once"
        line = (
            f"per micro-batch ({times}){_within(plan)}: each layer all-gathered in the "
            "forward and again in the backward and the root group once, "
            f"{format_bytes(plan.gather_bytes)} (the weights, {_short(plan.gather_dtype)}), and "
            "a reduce-scatter per layer and of the root group, "
            f"{format_bytes(plan.allreduce_bytes)} ({sums}); no all-gather after the update"
        )
        if plan.replica_bytes:
            groups = n // plan.split_over
            line += (
                f"; once per optimizer step, each device's block of the sums, "
                f"{format_bytes(plan.allreduce_bytes / plan.split_over)}, all-reduced across "
                f"the {groups} replica groups"
            )
    elif layout.state_split:
        count = "1 reduce-scatter"
        if layout.window_split:
            k = plan.accum_steps
            count = (
                f"{k} reduce-scatter(s), one per micro-batch,"
                if k
                else ("one reduce-scatter per micro-batch (accum_steps not sized: counted once)")
            )
        line = (
            f"per optimizer step: {count} of {format_bytes(plan.allreduce_bytes)} ({sums}) "
            f"and one all-gather of {format_bytes(plan.gather_bytes)} (the weights)"
        )
    else:
        line = f"all-reduce per optimizer step: {format_bytes(plan.allreduce_bytes)} ({sums})"
    if xla is not None and xla.allreduce_bytes is not None:
        line += f"; XLA's compiled step: {format_bytes(xla.allreduce_bytes)}"
    if n == 1:
        return line + "\n1 device: nothing to send."
    if plan.replica_bytes:
        s, groups = plan.split_over, n // plan.split_over
        line += (
            f"\nring algorithms: each device sends (S-1)/S = {(s - 1) / s:.3f} x each payload "
            f"within its shard group and 2(R-1)/R = {2 * (groups - 1) / groups:.3f} x its "
            f"block across the R = {groups} replica groups = {format_bytes(plan.ring_bytes)} "
            "per step (and receives as much)"
        )
    elif layout.state_split:
        line += (
            f"\nring algorithms over {n} devices: each sends (N-1)/N = {(n - 1) / n:.3f} x "
            f"each payload = {format_bytes(plan.ring_bytes)} per step (and receives as much)"
        )
    else:
        line += (
            f"\nring all-reduce over {n} devices: each device sends 2(N-1)/N = "
            f"{2 * (n - 1) / n:.3f} x that = {format_bytes(plan.ring_bytes)} (and receives as "
            "much)"
        )
    if plan.allreduce_seconds is not None:
        line += (
            f"\nat {format_bytes(plan.link_bandwidth)}/s per device: "
            f"{_seconds(plan.allreduce_seconds)} per optimizer step "
            "(bandwidth term only: no latency, no overlap with the backward pass)"
        )
    return line


def _within(plan: MemoryPlan) -> str:
    if plan.split_over == plan.num_devices:
        return ""
    return f", within each shard group of {plan.split_over}"


def _seconds(t: float) -> str:
    for unit, size in (("s", 1.0), ("ms", 1e-3)):
        if t >= size:
            return f"{t / size:.2f} {unit}"
    return f"{t / 1e-6:.2f} us"

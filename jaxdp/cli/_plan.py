"""``jaxdp plan``: per-device memory, the batch split that fits, and the all-reduce."""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import sys
import textwrap
from typing import Any

from .._stages import stage_layout
from ..plan._memory import (
    DEFAULT_HEADROOM,
    DTYPE_POLICIES,
    GATHER_DTYPES,
    OPTIMIZER_MOMENTS,
    MemoryPlan,
    check_stage_3,
    parse_bytes,
    parse_count,
    plan_memory,
)
from ..plan._report import XlaFigures, format_bytes, report

_MAX_EMULATED = 8  # per-device figures do not depend on the device count
# --tp lays the state out (abstractly: nothing allocated) on this many emulated CPU devices
# at most, whose count its ZeRO splits depend on.
_MAX_LAID_OUT = 64
# Without --global-batch-size: jaxdp train's rows per device (accum_steps 2 x micro_batch_size 16).
DEFAULT_SAMPLES_PER_DEVICE = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``jaxdp plan``'s options, added to its parser ``p`` (``jaxdp.cli._main.SUBCOMMANDS``)."""
    p.description = (
        "Estimates one device's memory (weights, gradients, optimizer state, "
        "accumulator, activations), whether it fits, the largest micro-batch and the "
        "accum_steps that reach the global batch, and the all-reduce per optimizer step. "
        "With --model it also compiles jaxdp's step and shows XLA's memory analysis, "
        "which then decides.\n\n"
        "Without --device-memory it shows the per-device figures only. Sizes: GB = 10^9 "
        "bytes, GiB = 2^30."
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--params",
        type=_arg(parse_count),
        metavar="COUNT",
        help="parameter count: 7e9, 7B, 125M (this or --model is required)",
    )
    what.add_argument(
        "--model",
        help="a reference model jaxdp builds: linear, mlp, cnn or transformer (this or "
        "--params is required)",
    )
    p.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="constructor argument of --model, e.g. d_model=256 or 'channels=(16, 32)'; "
        "repeatable (default: the model's own defaults)",
    )
    p.add_argument(
        "--device-memory",
        type=_arg(parse_bytes),
        metavar="SIZE",
        help="memory of one device: 80GB, 80GiB (default: none; the plan then decides "
        "nothing about what fits)",
    )
    p.add_argument(
        "--policy",
        choices=sorted(DTYPE_POLICIES),
        default=None,
        help="dtype policy (default: mixed-bf16 with --params, fp32 with --model)",
    )
    p.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZER_MOMENTS),
        default="adamw",
        help="what the optimizer state holds",
    )
    p.add_argument("--num-devices", type=int, default=1, metavar="N", help="data-parallel devices")
    p.add_argument(
        "--global-batch-size",
        "--global-batch",
        type=int,
        default=None,
        metavar="N",
        help="rows per optimizer step, on all devices (default: "
        f"{DEFAULT_SAMPLES_PER_DEVICE} per device, as jaxdp train's 2 x 16)",
    )
    p.add_argument(
        "--activation-bytes-per-sample",
        type=_arg(parse_bytes),
        default=None,
        metavar="SIZE",
        help="activation bytes one sample keeps for the backward pass (default: derived "
        "for --model, else unknown)",
    )
    p.add_argument(
        "--input-bytes-per-sample",
        type=_arg(parse_bytes),
        default=0.0,
        metavar="SIZE",
        help="bytes of one input row (default: derived for --model, else 0)",
    )
    p.add_argument(
        "--headroom",
        type=_arg(_fraction),
        default=DEFAULT_HEADROOM,
        metavar="FRACTION",
        help="fraction of device memory kept free: 0.15 or 15%% (default: 15%%)",
    )
    p.add_argument(
        "--link-bandwidth",
        type=_arg(parse_bytes),
        metavar="SIZE/s",
        help="what each device sends per second: 450GB/s, 400Gbit (default: none; no "
        "all-reduce time is predicted)",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=0,
        help="1: master weights and optimizer state split over the devices (ZeRO-1); 2: the "
        "gradient accumulator too; 3: the weights and gradients too, a layer gathered at a "
        "time (ZeRO-3 / FSDP; see --layers) (default: 0, all replicated)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="L",
        help="at --zero-stage 3: identical layers of the stack jaxdp.scan_layers loops over "
        "(one is gathered at a time); without it the gathered layer is not counted "
        "(default: none)",
    )
    p.add_argument(
        "--root-params",
        type=_arg(parse_count),
        default=0,
        metavar="COUNT",
        help="at --zero-stage 3: parameters outside the stack (embeddings, head, final "
        "norm), gathered whole per micro-batch (default: 0)",
    )
    p.add_argument(
        "--shards",
        type=int,
        default=None,
        metavar="S",
        help="at --zero-stage 3: HSDP (jaxdp.Parallel(shards=S)), the state split over "
        "shard groups of S devices (at least 2, dividing --num-devices), gathered within "
        "the group, and the gradient blocks all-reduced across the groups once per "
        "optimizer step (default: one group of every device)",
    )
    p.add_argument(
        "--gather-dtype",
        default=None,
        metavar="DTYPE",
        help=f"at --zero-stage 3: what the weights are gathered and computed in, one of "
        f"{', '.join(GATHER_DTYPES)} (jaxdp.Parallel(gather_dtype=...)) (default: the "
        "policy's: bfloat16 or float16 for a mixed policy, whose float32 master weights "
        "alone rest, else the parameters' own)",
    )
    p.add_argument(
        "--remat",
        choices=["dots", "full"],
        default=None,
        help="at --zero-stage 3: what the layer loop keeps for the backward "
        "(jaxdp.Parallel(remat=...)): dots, the matrix products' outputs, as the "
        "--activation-bytes-per-sample given; full, the layers' inputs (give the "
        "activations as full remat keeps them) (default: dots, the step's)",
    )
    p.add_argument(
        "--comm-dtype",
        choices=["bfloat16"],
        default=None,
        help="gradient sums sent in bfloat16 (default: fp32)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="M",
        help="with --model stack or transformer (the models with a tensor-parallel plan): "
        "tensor parallelism, M devices of a model axis per data rank (--num-devices data "
        "ranks x M devices), the model split by its Megatron plan; the per-device weights, "
        "gradients, optimizer state and accumulator are read from jaxdp's step laid out on "
        "that mesh, beside the same without the model axis (default: none)",
    )
    p.add_argument("--no-xla", action="store_true", help="with --model: skip XLA's analysis")
    p.set_defaults(run=run)


def _arg(parse: Any) -> Any:
    """An argparse type from a parser that raises ValueError with its own message."""

    def parse_arg(text: str) -> Any:
        try:
            return parse(text, name="value")
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).replace("value=", "", 1)) from None

    return parse_arg


def _fraction(text: str, *, name: str) -> float:
    value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={text!r} must be a fraction in [0, 1) or a percentage below 100%")
    return value


def run(args: argparse.Namespace) -> int:
    try:
        text = plan_report(args)
    except ValueError as e:  # a usage error: one line, exit status 2 as argparse's own
        print(f"jaxdp plan: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(text)
    return 0


def plan_report(args: argparse.Namespace) -> str:
    """The plan for parsed ``jaxdp plan`` arguments, as text."""
    global_batch_size, batch_note = args.global_batch_size, None
    if global_batch_size is None and isinstance(args.num_devices, int) and args.num_devices > 0:
        global_batch_size = DEFAULT_SAMPLES_PER_DEVICE * args.num_devices
        batch_note = (
            f"global batch size: {global_batch_size} (default, {DEFAULT_SAMPLES_PER_DEVICE} "
            "samples per device; --global-batch-size sets it)"
        )
    options = dict(
        device_memory=args.device_memory,
        policy=args.policy or ("mixed-bf16" if args.params is not None else "fp32"),
        optimizer=args.optimizer,
        num_devices=args.num_devices,
        global_batch_size=global_batch_size,
        headroom=args.headroom,
        link_bandwidth=args.link_bandwidth,
        activation_bytes_per_sample=args.activation_bytes_per_sample,
        input_bytes_per_sample=args.input_bytes_per_sample,
        zero_stage=args.zero_stage,
        comm_dtype=args.comm_dtype,
        layers=args.layers,
        root_params=args.root_params,
        shards=args.shards,
        gather_dtype=args.gather_dtype,
        remat=args.remat,
    )
    # Before any work (a --model is built and traced below).
    check_stage_3(
        args.zero_stage,
        args.num_devices,
        shards=args.shards,
        gather_dtype=args.gather_dtype,
        remat=args.remat,
    )
    if args.tp is not None:
        return _tp_report(args, options["policy"])
    if args.params is not None:
        if args.model_arg:
            raise ValueError("--model-arg needs --model")
        plan = plan_memory(params=args.params, **options)
        return _report(plan, batch_note=batch_note)
    from ..plan import _xla as xla

    spec = _model_spec(args, options["policy"])
    if args.activation_bytes_per_sample is None:
        options["activation_bytes_per_sample"] = xla.activation_bytes_per_sample(spec)
    options["input_bytes_per_sample"] = xla.input_bytes_per_sample(spec)
    if stage_layout(args.zero_stage).params_split and args.num_devices > 0:
        # The leaves stage 3 pads, counted padded over the shard group.
        options["padded_params"] = xla.padded_param_count(spec, args.shards or args.num_devices)
    plan = plan_memory(params=xla.param_count(spec), **options)
    shown = dict(model=spec.describe(), batch_note=batch_note)
    if args.no_xla:
        return _report(plan, note="XLA's analysis: skipped (--no-xla).", **shown)
    if stage_layout(plan.zero_stage).state_split:
        note = (
            "XLA's analysis: at --zero-stage 0 only (a stage's per-device figures shrink with "
            "the device count, and the plan compiles on at most 8 devices); the estimate above "
            "counts the split."
        )
        return _report(plan, note=note, **shown)
    if plan.device_memory is None:
        note = "XLA's analysis: needs --device-memory (it compiles the split that fits)."
        return _report(plan, note=note, **shown)
    if DTYPE_POLICIES[plan.policy].param_dtype is None:
        note = (
            f"XLA's analysis: not for policy {plan.policy} (jaxdp's step keeps no fp32 master "
            "copy of bf16/fp16 weights); --policy fp32 or bf16 compiles the step."
        )
        return _report(plan, note=note, **shown)
    return _report(plan, xla=_compile(spec, plan), **shown)


def _report(plan: MemoryPlan, *, batch_note: str | None, **kwargs: Any) -> str:
    """The report; the note on a default global batch only where a batch is sized."""
    if plan.activation_bytes_per_sample is None:
        batch_note = None
    return report(plan, batch_note=batch_note, **kwargs)


def _tp_report(args: argparse.Namespace, policy: str) -> str:
    """``--tp M``: one device's training state on a ``(data, model)`` mesh of
    ``--num-devices`` data ranks of ``M`` devices, read from the step's own layout, beside
    the same model without its plan on the data ranks alone."""
    from flax import nnx

    from ..models import MODEL_AXIS, TENSOR_PARALLEL, check_tp
    from ..plan._xla import laid_out_state

    tp, n = args.tp, args.num_devices
    if args.model is None or args.model not in TENSOR_PARALLEL:
        given = f"--model {args.model}" if args.model else "--params"
        raise ValueError(
            f"--tp {tp} needs --model with a tensor-parallel plan, one of {TENSOR_PARALLEL} "
            f"(its per-device bytes are read from the model's own layout), got {given}"
        )
    if not isinstance(tp, int) or tp < 1 or not isinstance(n, int) or n < 1:
        raise ValueError(f"--tp {tp} and --num-devices {n} must be positive integers")
    if args.shards is not None:
        raise ValueError(
            f"--tp {tp} with --shards {args.shards}: the plan lays out HSDP without a model "
            "axis only; leave out --shards"
        )
    if DTYPE_POLICIES[policy].param_dtype is None:
        raise ValueError(
            f"--tp {tp} reads jaxdp's step, which keeps no fp32 master copy of "
            f"half-precision weights: --policy fp32 or bf16, not {policy}"
        )
    if n * tp > _MAX_LAID_OUT:
        raise ValueError(
            f"--num-devices {n} x --tp {tp} = {n * tp} devices: the plan lays the state out "
            f"on emulated CPU devices, at most {_MAX_LAID_OUT}"
        )
    from .._mesh import data_mesh, emulate_cpu_devices

    # RuntimeError: JAX already started (library use); lay out on the devices there are.
    with contextlib.suppress(RuntimeError):
        emulate_cpu_devices(n * tp)  # the CPU backend only
    import jax
    import numpy as np

    there = jax.devices()
    if n * tp > len(there):
        raise ValueError(
            f"--num-devices {n} x --tp {tp} = {n * tp} devices, and JAX has started with "
            f"{len(there)}"
        )
    split, whole = _model_spec(args, policy, tp=True), _model_spec(args, policy)
    check_tp(nnx.eval_shape(split.make), tp)  # whole heads; before any layout
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.sharding.Mesh(
        np.array(there[: n * tp]).reshape(n, tp), ("data", MODEL_AXIS), axis_types=auto
    )
    stage = dict(zero_stage=args.zero_stage)
    ours = laid_out_state(split, args.optimizer, mesh, model_axes=(MODEL_AXIS,), **stage)
    plain = laid_out_state(whole, args.optimizer, data_mesh(n), **stage)
    rows = [
        ("weights", ours.weights, plain.weights),
        ("gradients (one micro-batch's)", ours.gradients, plain.gradients),
        (f"optimizer state ({args.optimizer})", ours.optimizer, plain.optimizer),
        ("gradient accumulator (fp32)", ours.accumulator, plain.accumulator),
        ("total", ours.total, plain.total),
    ]
    head = f"  {'per device':<32}{f'tp={tp}':>12}{'without':>12}"
    lines = [f"  {what:<32}{format_bytes(a):>12}{format_bytes(b):>12}" for what, a, b in rows]
    header = (
        f"jaxdp plan: {split.describe()}, {policy}, zero_stage={args.zero_stage}, on "
        f"{n} data rank(s) x tp={tp} ({n * tp} devices: a (data {n}, model {tp}) mesh); "
        f"without: the same {n} data rank(s), no model axis"
    )
    note = (
        "Read from jaxdp's step laid out on that mesh (Parallel(model_axes=('model',)), "
        "abstract_state: each leaf's shard, nothing allocated). --tp plans the training "
        "state only: activations, the batch, stage 3's gathered layer and XLA's buffers "
        "are not counted, and the options of memory, batch and link are not used."
    )
    wrap = functools.partial(textwrap.fill, width=100, break_on_hyphens=False)
    return "\n\n".join([wrap(header), "\n".join([head, *lines]), wrap(note)])


def _model_spec(args: argparse.Namespace, policy: str, *, tp: bool = False) -> Any:
    from ..plan import _xla as xla

    kwargs = {}
    for item in args.model_arg:
        name, sep, value = item.partition("=")
        try:
            kwargs[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            sep = ""
        if not sep:
            raise ValueError(f"--model-arg={item!r} must be NAME=VALUE with a Python literal VALUE")
    dtype = DTYPE_POLICIES[policy].param_dtype or "float32"
    return xla.reference_model(args.model, param_dtype=dtype, tp=tp, **kwargs)


def _compile(spec: Any, plan: MemoryPlan) -> XlaFigures:
    """XLA's choice and figures, compiled on a mesh of this machine's devices."""
    from .._inspect import all_reduces
    from .._mesh import data_mesh, emulate_cpu_devices
    from ..plan._xla import CompiledSteps, choose_micro_batch

    # RuntimeError: JAX already started (library use); compile on the devices there are.
    with contextlib.suppress(RuntimeError):
        emulate_cpu_devices(min(plan.num_devices, _MAX_EMULATED))  # the CPU backend only
    import jax

    mesh = data_mesh(min(plan.num_devices, len(jax.devices())))
    per_device = None
    if plan.global_batch_size is not None:
        per_device = plan.global_batch_size // plan.num_devices
    steps = CompiledSteps(spec, plan.optimizer, mesh)
    choice = choose_micro_batch(steps, usable=plan.usable, per_device=per_device)
    allreduce = None
    if choice.micro_batch_size is not None and mesh.devices.size > 1:
        compiled = steps.compile(choice.micro_batch_size, choice.accum_steps)
        allreduce = sum(r.bytes * r.executions[1] for r in all_reduces(compiled))
    return XlaFigures(
        platform=mesh.devices.flat[0].platform,
        compiled_devices=mesh.devices.size,
        micro_batch_size=choice.micro_batch_size,
        accum_steps=choice.accum_steps,
        memory=choice.memory,
        allreduce_bytes=allreduce,
        compiles=choice.compiles,
    )

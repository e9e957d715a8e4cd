"""``jaxdp plan``: per-device memory, the batch split that fits, and the all-reduce."""

from __future__ import annotations

import argparse
import ast
import contextlib
from typing import Any

from ..plan._memory import (
    DEFAULT_HEADROOM,
    DTYPE_POLICIES,
    OPTIMIZER_MOMENTS,
    MemoryPlan,
    parse_bytes,
    parse_count,
    plan_memory,
)
from ..plan._report import XlaFigures, report

_MAX_EMULATED = 8  # per-device figures do not depend on the device count


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="per-device memory of data-parallel training, and the batch split that fits",
        description="Estimates one device's memory (weights, gradients, optimizer state, "
        "accumulator, activations), whether it fits, the largest micro-batch and the "
        "accum_steps that reach the global batch, and the all-reduce per optimizer step. "
        "With --model it also compiles jaxdp's step and shows XLA's memory analysis, "
        "which then decides. Sizes: GB = 10^9 bytes, GiB = 2^30.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_arg(parse_count), help="parameter count: 7e9, 7B, 125M")
    what.add_argument(
        "--model", help="a reference model jaxdp builds: linear, mlp, cnn or transformer"
    )
    p.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="constructor argument of --model, e.g. d_model=256 or 'channels=(16, 32)'",
    )
    p.add_argument("--device-memory", required=True, type=_arg(parse_bytes), help="80GB, 80GiB")
    p.add_argument(
        "--policy",
        choices=sorted(DTYPE_POLICIES),
        default=None,
        help="dtype policy (default: mixed-bf16 with --params, fp32 with --model)",
    )
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_MOMENTS), default="adamw")
    p.add_argument("--num-devices", type=int, default=1, help="data-parallel devices")
    p.add_argument("--global-batch-size", "--global-batch", type=int, default=None)
    p.add_argument(
        "--activation-bytes-per-sample",
        type=_arg(parse_bytes),
        default=None,
        help="activation bytes one sample keeps for the backward pass (derived for --model)",
    )
    p.add_argument(
        "--input-bytes-per-sample",
        type=_arg(parse_bytes),
        default=0.0,
        help="bytes of one input row (derived for --model)",
    )
    p.add_argument(
        "--headroom",
        type=_arg(_fraction),
        default=DEFAULT_HEADROOM,
        help="fraction of device memory kept free: 0.15 or 15%% (default: 15%%)",
    )
    p.add_argument("--link-bandwidth", type=_arg(parse_bytes), help="per device: 450GB/s, 400Gbit")
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
    except ValueError as e:
        raise SystemExit(f"jaxdp plan: error: {e}") from None
    print(text)
    return 0


def plan_report(args: argparse.Namespace) -> str:
    """The plan for parsed ``jaxdp plan`` arguments, as text."""
    options = dict(
        device_memory=args.device_memory,
        policy=args.policy or ("mixed-bf16" if args.params is not None else "fp32"),
        optimizer=args.optimizer,
        num_devices=args.num_devices,
        global_batch_size=args.global_batch_size,
        headroom=args.headroom,
        link_bandwidth=args.link_bandwidth,
        activation_bytes_per_sample=args.activation_bytes_per_sample,
        input_bytes_per_sample=args.input_bytes_per_sample,
    )
    if args.params is not None:
        if args.model_arg:
            raise ValueError("--model-arg needs --model")
        return report(plan_memory(params=args.params, **options))
    from ..plan import _xla as xla

    spec = _model_spec(args, options["policy"])
    if args.activation_bytes_per_sample is None:
        options["activation_bytes_per_sample"] = xla.activation_bytes_per_sample(spec)
    options["input_bytes_per_sample"] = xla.input_bytes_per_sample(spec)
    plan = plan_memory(params=xla.param_count(spec), **options)
    if args.no_xla:
        return report(plan, model=spec.describe(), note="XLA's analysis: skipped (--no-xla).")
    if DTYPE_POLICIES[plan.policy].param_dtype is None:
        note = (
            f"XLA's analysis: not for policy {plan.policy} (jaxdp's step keeps no fp32 master "
            "copy of bf16/fp16 weights); --policy fp32 or bf16 compiles the step."
        )
        return report(plan, model=spec.describe(), note=note)
    return report(plan, model=spec.describe(), xla=_compile(spec, plan))


def _model_spec(args: argparse.Namespace, policy: str) -> Any:
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
    return xla.reference_model(args.model, param_dtype=dtype, **kwargs)


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

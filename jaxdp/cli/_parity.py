"""``jaxdp parity``: jaxdp and torch_ref trained side by side, compared step by step.

Either a reference model (``--model NAME``), a user's torch model and its JAX port, in
Flax NNX, Flax Linen or equinox (``--torch-model MODULE:ATTR --jax-model MODULE:ATTR
--data PATH.npz``), or a team's own torch script that records itself with a
``torch_ref.Recorder`` (``--torch-script FILE`` runs it under torchrun, ``--torch-record
PATH`` reads what it recorded) against its port.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pathlib
import pickle
import sys
import tempfile
from typing import Any, NoReturn

from ..models import MODELS
from ..parity import OPTIMIZERS, RTOL, ParityConfig

# Flags that only a reference model (--model) or only a user's models take.
REFERENCE_ONLY = ("num_samples", "sync_batchnorm", "zero_stage", "shards", "remat", "tp")
PORT_ONLY = ("loss", "mapping", "jax_optimizer", "locate", "loss_reduction", "schedule")
# What a recorded script's record gives (its layout, data and optimizer): refused with one.
RECORDED = ("accum_steps", "micro_batch_size", "steps", "dtype", "seed", "last_window")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``jaxdp parity``'s options, added to its parser ``p`` (``jaxdp.cli._main.SUBCOMMANDS``)."""
    defaults = ParityConfig()
    p.description = (
        "Same initial weights, data, order and hyper-parameters in jaxdp and in "
        "torch_ref, on a reference model (--model) or on your torch model and its JAX port (Flax "
        "NNX, Flax Linen or equinox) "
        "(--torch-model, --jax-model, --data), or on your own torch training script as "
        "its torch_ref.Recorder recorded it (--torch-script or --torch-record, with "
        "--torch-model and --jax-model); compares weights and losses after every "
        "optimizer step and prints the largest differences, and for your models where they "
        "first diverge. Exit status 1 if a step is beyond tolerance."
    )
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help="a reference model (default: mlp, when no --torch-model is given)",
    )
    _add_port_flags(p)
    p.add_argument(
        "--optimizer",
        metavar="NAME|MODULE:ATTR",
        default=None,
        help=f"optimizer, the same in both: one of {', '.join(sorted(OPTIMIZERS))}, or "
        "MODULE:ATTR of a jaxdp.parity.OptimizerSpec (parameter groups, any rates) "
        f"(default: {defaults.optimizer}; a --torch-record's own)",
    )
    p.add_argument(
        "--num-devices",
        type=int,
        default=defaults.num_devices,
        metavar="N",
        help="jaxdp devices, and torch DDP ranks",
    )
    p.add_argument(
        "--accum-steps",
        type=int,
        default=defaults.accum_steps,
        metavar="K",
        help="micro-batches per device per optimizer step",
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=defaults.micro_batch_size,
        metavar="B",
        help="rows per micro-batch per device",
    )
    p.add_argument(
        "--steps", type=int, default=defaults.steps, metavar="N", help="optimizer steps compared"
    )
    p.add_argument(
        "--dtype", choices=sorted(RTOL), default=defaults.dtype, help="parameters and compute"
    )
    p.add_argument(
        "--path",
        choices=["fused", "multisteps"],
        default=defaults.path,
        help="jaxdp's accumulation path",
    )
    p.add_argument(
        "--strategy",
        choices=["shard_map", "pmap"],
        default=defaults.strategy,
        help="how jaxdp's step is mapped over the devices",
    )
    p.add_argument(
        "--num-samples",
        type=int,
        default=None,
        metavar="N",
        help=f"--model: size of the synthetic data set, epochs repeat as needed "
        f"(default: {defaults.num_samples})",
    )
    p.add_argument(
        "--last-window",
        choices=["drop", "step"],
        default=defaults.last_window,
        help="an epoch's incomplete last accumulation window: dropped, or one short step",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="weights and data; the sampler uses seed + epoch",
    )
    p.add_argument(
        "--torch-device",
        choices=["cpu", "cuda"],
        default=defaults.torch_device,
        help="where torch_ref trains (cuda: nccl, one GPU per rank, TF32 off); jaxdp uses "
        "JAX's default backend",
    )
    p.add_argument(
        "--sync-batchnorm",
        action="store_true",
        default=None,
        help="cnn_bn: SyncBatchNorm in torch_ref, batch_stats='sync' in jaxdp (default: DDP's "
        "per-rank statistics with broadcast_buffers=True, batch_stats='local')",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=None,
        help="--model: jaxdp's Parallel(zero_stage=...) against torch's counterpart: 1 and 2 "
        "ZeroRedundancyOptimizer on DDP, 3 FSDP2 (fully_shard per block, then the root) "
        "(default: 0, DDP)",
    )
    p.add_argument(
        "--shards",
        type=int,
        metavar="S",
        default=None,
        help="--model with --zero-stage 3: HSDP, parameters split over groups of S devices, "
        "num-devices / S replica groups (torch: a (replicate, shard) device mesh) (default: "
        "every device, FSDP)",
    )
    p.add_argument(
        "--remat",
        metavar="POLICY",
        default=None,
        help="--model with --zero-stage 3: what jaxdp's layer loop keeps for the backward "
        "(Parallel(remat=...)): dots (the matrix products' outputs), full (nothing) or the "
        "name of a jax.checkpoint_policies policy (default: dots). torch's FSDP2 keeps "
        "every activation: the values are the same either way",
    )
    p.add_argument(
        "--tp",
        type=int,
        metavar="M",
        default=None,
        help="--model stack: tensor parallelism, M devices of a model axis per data rank: "
        "jaxdp on a (data, model) mesh with the model's Megatron plan "
        "(Parallel(model_axes=('model',))), torch's parallelize_module on a (dp, tp) "
        "DeviceMesh under DDP, or FSDP2 with --zero-stage 1 or 2 (num-devices x M "
        "devices and ranks) (default: 1, none)",
    )
    p.add_argument(
        "--plot",
        metavar="PATH.png",
        help="a PNG of the divergence per step, log scale (default: none)",
    )
    p.set_defaults(run=_run_parity_command)


def _add_port_flags(p: argparse.ArgumentParser) -> None:
    spec = "MODULE:ATTR (MODULE a module name or a .py path)"
    p.add_argument(
        "--torch-model",
        metavar="MODULE:ATTR",
        help=f"your torch model: {spec} (default: none, a reference --model)",
    )
    p.add_argument(
        "--jax-model",
        metavar="MODULE:ATTR",
        help=f"its JAX port: {spec}; a Flax NNX, Flax Linen or equinox module, or a class or "
        "factory called with rngs=, key= and param_dtype= for those it takes; an unbound Linen "
        "module is initialized on the data (required with --torch-model)",
    )
    p.add_argument(
        "--data",
        metavar="PATH.npz",
        help="the data set: arrays x and y (required with --torch-model, unless a record gives it)",
    )
    p.add_argument(
        "--torch-script",
        metavar="FILE",
        help="your own torch training script, recording itself with torch_ref.Recorder: run "
        "under torchrun --standalone --nproc-per-node N FILE (N: --num-devices), the record "
        "written to $TORCH_REF_RECORD (--torch-record, or a temporary file), then compared "
        "(default: none)",
    )
    p.add_argument(
        "--torch-record",
        metavar="PATH",
        help="what a torch_ref.Recorder saved (your script under its own launcher): the "
        "layout, data, weights, optimizer and rates come from it; with --torch-script, "
        "where its record is written (default: none)",
    )
    p.add_argument(
        "--loss",
        metavar="LOSS",
        help="mse, cross_entropy, MODULE:ATTR (one (output, y) function for both) or "
        "MODULE:TORCH_ATTR,JAX_ATTR (default: cross_entropy)",
    )
    p.add_argument(
        "--loss-reduction",
        choices=["mean", "weighted"],
        default=None,
        help="weighted: --loss returns (loss_sum, count) per micro-batch, and each step "
        "divides the sum over every micro-batch and device by the global count (a "
        "token-weighted loss over padded rows) (default: mean)",
    )
    p.add_argument(
        "--schedule",
        metavar="TORCH_SPEC,JAX_SPEC",
        help="the learning rate per step: MODULE:ATTR of a factory optimizer -> torch "
        "LRScheduler (LambdaLR, OneCycleLR...), a comma, and MODULE:ATTR of the port's "
        "optax schedule (default: --optimizer's constant rate); with a record, the port's "
        "optax schedule alone (torch's rates are recorded)",
    )
    p.add_argument(
        "--mapping",
        metavar="MODULE:ATTR",
        help="a dict or function for the weights (default: by names and layer kinds)",
    )
    p.add_argument(
        "--jax-optimizer",
        metavar="MODULE:ATTR",
        help="the port's optax optimizer, or a factory of it (default: torch's --optimizer "
        "through jaxdp.parity.optax_like_torch)",
    )
    p.add_argument(
        "--locate",
        action="store_true",
        default=None,
        help="run the divergence locator even if every step passes (it runs at the first "
        "step beyond tolerance anyway)",
    )


def _error(message: str) -> NoReturn:
    """A usage error: one line, exit status 2 as argparse's own."""
    print(f"jaxdp parity: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check_flags(args: argparse.Namespace) -> bool:
    """True for a user's models; errors out on a flag the chosen form does not take."""
    if args.torch_script or args.torch_record:
        _check_record_flags(args)
        return True
    port = [args.torch_model, args.jax_model, args.data]
    if not any(port):
        given = [f"--{k.replace('_', '-')}" for k in PORT_ONLY if getattr(args, k) is not None]
        if given:
            _error(f"{', '.join(given)}: only with --torch-model, --jax-model and --data")
        return False
    if not all(port):
        _error("--torch-model, --jax-model and --data go together")
    if args.model is not None:
        _error("--model names a reference model; give it or --torch-model/--jax-model")
    given = [f"--{k.replace('_', '-')}" for k in REFERENCE_ONLY if getattr(args, k) is not None]
    if given:
        _error(f"{', '.join(given)}: only with --model (a reference model)")
    return True


def _check_record_flags(args: argparse.Namespace) -> None:
    """A recorded script: its record gives the layout, the data and the optimizer."""
    source = "--torch-script" if args.torch_script else "--torch-record"
    if not (args.torch_model and args.jax_model):
        _error(f"{source} needs --torch-model (the script's model) and --jax-model (its port)")
    defaults = ParityConfig()
    given = [k for k in RECORDED if getattr(args, k) != getattr(defaults, k)]
    given += [k for k in ("data", "optimizer", "model") if getattr(args, k) is not None]
    given += [k for k in REFERENCE_ONLY if getattr(args, k) is not None]
    if args.torch_device != defaults.torch_device:
        given.append("torch_device")
    if not args.torch_script and args.num_devices != defaults.num_devices:
        given.append("num_devices")
    if given:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in given)
        _error(f"{flags}: the record gives these (its script's own); leave them out")
    if args.schedule and "," in args.schedule:
        _error(
            f"--schedule {args.schedule!r}: torch's rates are recorded; give the port's optax "
            "schedule alone (MODULE:ATTR)"
        )
    if args.torch_script and not pathlib.Path(args.torch_script).is_file():
        _error(f"--torch-script {args.torch_script!r} is not a file")
    if not args.torch_script and not pathlib.Path(args.torch_record).is_file():
        _error(f"--torch-record {args.torch_record!r} is not a file")


def _run_parity_command(args: argparse.Namespace) -> int:
    import jax

    from .._mesh import emulate_cpu_devices

    port = _check_flags(args)
    try:
        importlib.import_module("torch_ref")  # imports torch too
    except ImportError as e:
        _error(
            f"needs PyTorch ({e}); on a CPU machine: pip install torch "
            "--index-url https://download.pytorch.org/whl/cpu (torch_ref ships with jaxdp)"
        )
    if args.torch_device == "cuda":  # before either side trains (a port's torch goes first)
        from ..parity._runner import check_torch_gpus

        try:
            check_torch_gpus(args.num_devices)
        except ValueError as e:
            _error(str(e))
    record = None
    if args.torch_script or args.torch_record:
        record = _record(args)
        args.num_devices, args.dtype = record.num_devices, record.dtype
    # CPU only; before the backend starts. A model axis: tp devices per data rank.
    emulate_cpu_devices(max(args.num_devices * (getattr(args, "tp", None) or 1), 1))
    jax.config.update("jax_enable_x64", args.dtype == "float64")
    if record is not None:
        report = _compare_record(args, record)
    else:
        report = _compare_ports(args) if port else _compare_reference(args)
    from ..parity import format_parity, plot_parity

    print(format_parity(report))
    if args.plot:
        plot_parity(report, args.plot)
        print(f"plot: {args.plot}")
    return 0 if report.passed else 1


def _record(args: argparse.Namespace) -> Any:
    """The script's record: run under torchrun first with --torch-script."""
    import torch_ref

    if not args.torch_script:
        try:
            return torch_ref.load_record(args.torch_record)
        except (ValueError, pickle.UnpicklingError, EOFError) as e:
            _error(f"--torch-record {args.torch_record!r}: {e}")
    with tempfile.TemporaryDirectory(prefix="jaxdp-parity-") as tmp:
        path = args.torch_record or pathlib.Path(tmp, "record.pkl")
        print(f"recording: torchrun --nproc-per-node {args.num_devices} {args.torch_script}")
        try:
            return torch_ref.record_script(
                args.torch_script, num_devices=args.num_devices, path=path
            )
        except (RuntimeError, ValueError) as e:  # the script failed: nothing to compare
            _error(f"--torch-script {args.torch_script}: {e}")


def _compare_record(args: argparse.Namespace, record: Any) -> Any:
    from torch_ref import load_attr

    from ..parity._recorded import compare_recorded

    try:
        return compare_recorded(
            record,
            args.torch_model,
            args.jax_model,
            loss=args.loss or "cross_entropy",
            jax_optimizer=_jax_optimizer(args.jax_optimizer),
            schedule=load_attr(args.schedule) if args.schedule else None,
            mapping=load_attr(args.mapping) if args.mapping else None,
            path=args.path,
            strategy=args.strategy,
            locate=args.locate,
            loss_reduction=args.loss_reduction or "mean",
        )
    except ValueError as e:
        _error(str(e))


def _jax_optimizer(spec: str | None) -> Any:
    """``--jax-model``'s optax optimizer, or a factory's."""
    from torch_ref import load_attr

    if not spec:
        return None
    optimizer = load_attr(spec)
    return optimizer if hasattr(optimizer, "update") else optimizer()


def _optimizer(spec: str | None) -> Any:
    """``--optimizer``: a preset's name, or MODULE:ATTR of an OptimizerSpec."""
    from ..parity import OptimizerSpec

    if spec is None or spec in OPTIMIZERS:
        return spec or ParityConfig().optimizer
    if ":" not in spec:
        _error(f"--optimizer {spec!r} must be one of {sorted(OPTIMIZERS)} or MODULE:ATTR")
    from torch_ref import load_attr

    try:
        optimizer = load_attr(spec)
    except (ImportError, ValueError) as e:
        _error(f"--optimizer {spec!r}: {e}")
    if not isinstance(optimizer, OptimizerSpec):
        _error(f"--optimizer {spec!r} is {type(optimizer).__name__!r}, not an OptimizerSpec")
    return optimizer


def _compare_reference(args: argparse.Namespace) -> Any:
    from ..parity import run_parity
    from ..parity._runner import check_config, torch_config

    fields = {f.name for f in dataclasses.fields(ParityConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    given["optimizer"] = _optimizer(args.optimizer)
    try:
        config = ParityConfig(**{"model": "mlp", **given})
        check_config(config)  # before either side trains
        # torch_ref's own rules too (its models with a Megatron plan, for --tp): jaxdp's
        # reference models with one are more than torch_ref's.
        torch_config(config)
    except ValueError as e:
        _error(str(e))
    return run_parity(config)


def _compare_ports(args: argparse.Namespace) -> Any:
    import numpy as np

    from torch_ref import load_attr

    from ..parity._compare_models import checked_port, compared

    with np.load(args.data) as npz:
        data = {k: npz[k] for k in npz.files}
    jax_optimizer = _jax_optimizer(args.jax_optimizer)
    try:  # every check, and jaxdp's step traced, before either side trains
        port = checked_port(
            args.torch_model,
            args.jax_model,
            data,
            loss=args.loss or "cross_entropy",
            optimizer=_optimizer(args.optimizer),
            jax_optimizer=jax_optimizer,
            mapping=load_attr(args.mapping) if args.mapping else None,
            num_devices=args.num_devices,
            accum_steps=args.accum_steps,
            micro_batch_size=args.micro_batch_size,
            steps=args.steps,
            dtype=args.dtype,
            path=args.path,
            strategy=args.strategy,
            seed=args.seed,
            last_window=args.last_window,
            torch_device=args.torch_device,
            locate=args.locate,
            loss_reduction=args.loss_reduction or "mean",
            schedule=_schedule(args.schedule),
        )
    except ValueError as e:
        _error(str(e))
    return compared(port, locate=args.locate, rtol=None, atol=None)


def _schedule(spec: str | None) -> tuple[str, str] | None:
    """``--schedule TORCH_SPEC,JAX_SPEC`` as compare_models' pair of specs."""
    if spec is None:
        return None
    torch_side, comma, jax_side = spec.partition(",")
    module = torch_side.partition(":")[0]
    if not comma or ":" not in torch_side:
        _error(f"--schedule {spec!r} must be TORCH_SPEC,JAX_SPEC (MODULE:ATTR each)")
    if ":" not in jax_side:  # JAX_SPEC's module may be left out: TORCH's
        jax_side = f"{module}:{jax_side}"
    return torch_side, jax_side

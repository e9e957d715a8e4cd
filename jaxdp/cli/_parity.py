"""``jaxdp parity``: jaxdp and torch_ref trained side by side, compared step by step."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from ..models._reference import MODELS
from ..parity._optim import OPTIMIZERS
from ..parity._runner import RTOL, ParityConfig, format_parity, run_parity


def add_parity_command(sub: Any) -> None:
    """``jaxdp parity``: registered in ``jaxdp.cli._main.SUBCOMMANDS``."""
    defaults = ParityConfig()
    p = sub.add_parser(
        "parity",
        help="train jaxdp and torch_ref (PyTorch DDP + GA) side by side and compare",
        description="Same initial weights, data, order and hyper-parameters in jaxdp and in "
        "torch_ref; compares weights and losses after every optimizer step and prints the "
        "largest differences. Exit status 1 if a step is beyond tolerance.",
    )
    p.add_argument(
        "--model", choices=sorted(MODELS), default=defaults.model, help="reference model"
    )
    p.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default=defaults.optimizer,
        help="optimizer, the same in both",
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
        default=defaults.num_samples,
        metavar="N",
        help="size of the synthetic data set (epochs repeat as needed)",
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
        help="cnn_bn: SyncBatchNorm in torch_ref, batch_stats='sync' in jaxdp (default: DDP's "
        "per-rank statistics with broadcast_buffers=True, batch_stats='local')",
    )
    p.set_defaults(run=_run_parity_command)


def _run_parity_command(args: Any) -> int:
    import jax

    from .._mesh import emulate_cpu_devices

    try:
        importlib.import_module("torch_ref")  # imports torch too
    except ImportError as e:
        raise SystemExit(
            f"jaxdp parity: error: needs PyTorch ({e}); on a CPU machine: pip install torch "
            "--index-url https://download.pytorch.org/whl/cpu (torch_ref ships with jaxdp)"
        ) from e

    emulate_cpu_devices(max(args.num_devices, 1))  # CPU only; before the backend starts
    jax.config.update("jax_enable_x64", args.dtype == "float64")
    fields = {f.name for f in dataclasses.fields(ParityConfig)}
    config = ParityConfig(**{k: v for k, v in vars(args).items() if k in fields})
    report = run_parity(config)
    print(format_parity(report))
    return 0 if report.passed else 1

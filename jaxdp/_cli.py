"""The ``jaxdp`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from ._parity import add_parity_command
from ._plan_cli import add_parser as plan_parser

DEFAULT_CPU_DEVICES = 4


def _train_parser(sub: argparse._SubParsersAction) -> None:
    from ._train import TrainConfig

    defaults = TrainConfig()
    p = sub.add_parser(
        "train",
        help="train an MLP on the digits images, data-parallel",
        description="Data-parallel training with gradient accumulation on "
        "scikit-learn's digits images; prints the batch identity, a "
        "progress bar and the held-out accuracy.",
    )
    p.add_argument(
        "--num-devices",
        type=int,
        default=None,
        help="data-parallel devices (default: all; on CPU, --cpu-devices emulated)",
    )
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=DEFAULT_CPU_DEVICES,
        help="CPU devices to emulate when running on CPU (default: %(default)s)",
    )
    p.add_argument(
        "--accum-steps",
        type=int,
        default=defaults.accum_steps,
        help="micro-batches per device per optimizer step (default: %(default)s)",
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=defaults.micro_batch_size,
        help="rows per micro-batch per device (default: %(default)s)",
    )
    p.add_argument("--epochs", type=int, default=defaults.epochs, help="(default: %(default)s)")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default=defaults.optimizer)
    p.add_argument("--learning-rate", "--lr", type=float, default=defaults.learning_rate)
    p.add_argument(
        "--path",
        choices=["fused", "multisteps"],
        default=defaults.path,
        help="accumulation path (default: %(default)s)",
    )
    p.add_argument("--strategy", choices=["shard_map", "pmap"], default=defaults.strategy)
    p.add_argument("--hidden", type=int, default=defaults.hidden, help="MLP hidden width")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--metrics-out", default=None, help="write per-step metrics as JSON lines")
    p.add_argument("--summary-out", default=None, help="write the final summary as JSON")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar (default: only on a terminal)",
    )
    p.set_defaults(run=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from ._mesh import emulate_cpu_devices
    from ._train import TrainConfig, train

    # Before JAX starts its backend; it affects the CPU backend only, so on a
    # GPU machine the default still trains on all GPUs.
    emulate_cpu_devices(args.cpu_devices)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    summary = train(config)
    if args.summary_out:
        with open(args.summary_out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


# One entry per subcommand: a function that adds its parser to ``sub`` and
# sets ``run`` (taking the parsed namespace, returning the exit status).
SUBCOMMANDS = (_train_parser, add_parity_command, plan_parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxdp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(sub)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

"""The ``jaxdp`` command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from ._launch import add_launch_command
from ._parity import add_parity_command
from ._plan import add_parser as plan_parser
from .bench._runner import add_bench_command

DEFAULT_CPU_DEVICES = 4


def _train_parser(sub: argparse._SubParsersAction) -> None:
    from ._train import TrainConfig

    defaults = TrainConfig()
    p = sub.add_parser(
        "train",
        help="train a model on the digits images, data-parallel",
        description="Data-parallel training with gradient accumulation on "
        "scikit-learn's digits images; prints the batch identity, a "
        "progress bar and the held-out accuracy. With --checkpoint-dir it "
        "saves checkpoints that --resume continues exactly; SIGINT or SIGTERM "
        "stops at the next micro-batch with a checkpoint there.",
    )
    p.add_argument("--model", choices=["mlp", "cnn"], default=defaults.model)
    p.add_argument(
        "--num-devices",
        type=int,
        default=None,
        help="data-parallel devices (default: all; on CPU, --cpu-devices emulated)",
    )
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="CPU devices to emulate when running on CPU (default: $JAXDP_CPU_DEVICES, "
        f"which jaxdp launch sets, else {DEFAULT_CPU_DEVICES})",
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
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="train until this epoch (default: 15 without --steps, else no limit)",
    )
    p.add_argument("--steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default=defaults.optimizer)
    p.add_argument("--learning-rate", "--lr", type=float, default=defaults.learning_rate)
    p.add_argument(
        "--path",
        choices=["fused", "multisteps"],
        default=defaults.path,
        help="accumulation path (default: %(default)s)",
    )
    p.add_argument("--strategy", choices=["shard_map", "pmap"], default=defaults.strategy)
    p.add_argument(
        "--precision",
        choices=["float32", "float64", "bfloat16"],
        default=defaults.precision,
        help="parameters and compute; bfloat16: bfloat16 compute, float32 parameters",
    )
    p.add_argument("--hidden", type=int, default=defaults.hidden, help="MLP hidden width")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (orbax)")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="optimizer steps between checkpoints (default: only at the end)",
    )
    p.add_argument(
        "--keep", type=int, default=defaults.keep, help="checkpoints kept (default: %(default)s)"
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in the dir"
    )
    p.add_argument(
        "--force-resume",
        action="store_true",
        help="resume even with another global batch size (changes the data order)",
    )
    p.add_argument("--metrics-out", default=None, help="write per-step metrics as JSON lines")
    p.add_argument("--summary-out", default=None, help="write the final summary as JSON")
    p.add_argument("--plot", default=None, help="write the loss curve to this PNG file")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar (default: only on a terminal)",
    )
    p.set_defaults(run=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    import os

    import jax

    from .._distributed import ENV_CPU_DEVICES, initialize
    from .._train_state import NonFiniteError
    from ..checkpoint._rules import CheckpointError
    from ._train import TrainConfig, train

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        config = TrainConfig(
            **{k: v for k, v in vars(args).items() if k in fields and v is not None}
        )
    except ValueError as e:
        raise SystemExit(f"jaxdp train: error: {e}") from None
    # Before JAX starts its backend. The CPU device count affects the CPU
    # backend only, so on a GPU machine the default still trains on all GPUs.
    # Under jaxdp launch (or Slurm, Open MPI, ...) this joins the other processes.
    cpu_devices = args.cpu_devices
    if cpu_devices is None and not os.environ.get(ENV_CPU_DEVICES):
        cpu_devices = DEFAULT_CPU_DEVICES
    try:
        initialize(cpu_devices=cpu_devices)
    except ValueError as e:
        raise SystemExit(f"jaxdp train: error: {e}") from None
    if config.precision == "float64":
        jax.config.update("jax_enable_x64", True)
    with _stop_on_signals() as stopped_by, warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            summary = train(config, stop=lambda _: stopped_by[0] is not None)
        except (CheckpointError, NonFiniteError) as e:
            raise SystemExit(f"jaxdp train: error: {e}") from None
    if args.summary_out and jax.process_index() == 0:
        with open(args.summary_out, "w") as f:
            json.dump(summary, f, indent=2)
    # The shell's convention for a process ended by a signal; a process that
    # stopped because a peer process was signalled reports SIGTERM.
    signum = stopped_by[0]
    if signum is None and summary["stopped"]:
        signum = signal.SIGTERM
    return 0 if signum is None else 128 + signum


def _show_warning(message: Warning | str, category: type[Warning], *args: Any, **kw: Any) -> None:
    print(f"jaxdp train: warning: {message}", file=sys.stderr)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[list[int | None]]:
    """Turns the first SIGINT/SIGTERM into a request to stop; the second acts as usual."""
    stopped_by: list[int | None] = [None]
    # None: a handler installed outside Python (JAX's preemption notifier takes
    # SIGTERM in multi-process runs); the default action is what "as usual" means.
    previous = {s: signal.getsignal(s) or signal.SIG_DFL for s in (signal.SIGINT, signal.SIGTERM)}

    def request(signum: int, frame: Any) -> None:
        stopped_by[0] = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this micro-batch", file=sys.stderr)
        for s, handler in previous.items():
            signal.signal(s, handler)

    for s in previous:
        signal.signal(s, request)
    try:
        yield stopped_by
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# One entry per subcommand: a function that adds its parser to ``sub`` and
# sets ``run`` (taking the parsed namespace, returning the exit status).
SUBCOMMANDS = (
    _train_parser,
    add_parity_command,
    plan_parser,
    add_launch_command,
    add_bench_command,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``jaxdp`` command line on ``argv`` (default: ``sys.argv[1:]``); returns the
    exit status."""
    parser = argparse.ArgumentParser(prog="jaxdp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(sub)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

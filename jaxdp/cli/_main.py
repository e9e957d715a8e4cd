"""The ``jaxdp`` command line: its parser, ``--version`` and the ``train`` subcommand."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import json
import os
import pathlib
import signal
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from .. import __version__
from ._compile_cache import add_compile_options, compile_cache
from ._config import DEFAULT_EPOCHS, TrainConfig
from ._extra import require_extra
from ._help import Parser
from ._interrupt import interruptible, lend_sigint

DEFAULT_CPU_DEVICES = 4


def train_arguments(p: argparse.ArgumentParser) -> None:
    """``jaxdp train``'s options, added to its parser ``p``."""
    p.description = (
        "Data-parallel training with gradient accumulation on scikit-learn's "
        "digits images; prints the batch identity, a progress bar and the held-out "
        "accuracy.\n\n"
        "With --checkpoint-dir it saves checkpoints, one directory per optimizer step, that "
        "--resume continues exactly; a resume takes every option not given from the "
        "checkpoint. SIGINT or SIGTERM stops at the next micro-batch with a checkpoint "
        "there (unless that optimizer step is checkpointed already)."
    )
    defaults = TrainConfig()
    _model_options(_options(p, "model and optimizer"), defaults)
    _batch_options(_options(p, "devices, batch and length"), defaults)
    _checkpoint_options(_options(p, "checkpoints"), defaults)
    _output_options(_options(p, "output"))
    add_compile_options(p)
    p.set_defaults(run=_run_train)


def _options(p: argparse.ArgumentParser, title: str) -> Callable[..., Any]:
    """``add_argument`` of a new group of ``p``, with None as every option's default.

    None tells a resume which options were given and which to take from the
    checkpoint; TrainConfig supplies a fresh run's defaults, which the help shows."""
    return functools.partial(p.add_argument_group(title).add_argument, default=None)


def _model_options(option: Callable[..., Any], d: TrainConfig) -> None:
    option(
        "--model",
        choices=["mlp", "cnn", "gpt"],
        help="reference model; gpt: a GPT of 4 blocks scanned by jaxdp.scan_layers on the "
        "digits' 64 pixels as tokens, classifying from the last (default: gpt at "
        "--zero-stage 3, else mlp)",
    )
    option(
        "--data",
        metavar="PATH",
        help="a .npz with x (features, or images [n, h, w(, c)] for the cnn) and integer "
        "labels y, or a directory with x.npy and y.npy (read as memmaps); the model is "
        "sized from it (default: scikit-learn's digits)",
    )
    option(
        "--num-classes",
        metavar="N",
        type=int,
        help="classes of --data's labels, when some have no row (default: the largest label + 1)",
    )
    option(
        "--hidden",
        metavar="WIDTH",
        type=int,
        help=f"MLP hidden width, or the GPT's d_model (default: {d.hidden})",
    )
    option(
        "--precision",
        choices=["float32", "float64", "bfloat16"],
        help="parameters and compute; bfloat16: bfloat16 compute, float32 parameters "
        f"(default: {d.precision})",
    )
    option(
        "--optimizer",
        choices=["adamw", "sgd"],
        help=f"adamw, or sgd with momentum 0.9 (default: {d.optimizer})",
    )
    option(
        "--learning-rate",
        "--lr",
        metavar="LR",
        type=float,
        help=f"learning rate (default: {d.learning_rate})",
    )
    option(
        "--seed",
        metavar="SEED",
        type=int,
        help=f"model init, held-out split, data order (default: {d.seed})",
    )
    option(
        "--skip-nonfinite",
        action=argparse.BooleanOptionalAction,
        help="skip (and report) an update with NaN or Inf gradients or loss, up to 10 in a "
        "row; --no-skip-nonfinite applies it and stops there, naming the step (default: skip)",
    )


def _batch_options(option: Callable[..., Any], d: TrainConfig) -> None:
    option("--num-devices", metavar="N", type=int, help="data-parallel devices (default: all)")
    option(
        "--cpu-devices",
        metavar="N",
        type=int,
        help="CPU devices to emulate when running on CPU (default: $JAXDP_CPU_DEVICES, "
        f"which jaxdp launch sets, else {DEFAULT_CPU_DEVICES})",
    )
    option(
        "--accum-steps",
        metavar="K",
        type=int,
        help=f"micro-batches per device per optimizer step (default: {d.accum_steps})",
    )
    option(
        "--micro-batch-size",
        metavar="B",
        type=int,
        help=f"rows per micro-batch per device (default: {d.micro_batch_size})",
    )
    option(
        "--path",
        choices=["fused", "multisteps"],
        help="accumulation path: one call per optimizer step, or one per micro-batch "
        f"(default: {d.path})",
    )
    option(
        "--strategy",
        choices=["shard_map", "pmap"],
        help=f"how the step is mapped over the devices (default: {d.strategy})",
    )
    option(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        help="1: the optimizer state split over the devices (ZeRO-1: one reduce-scatter and "
        "one all-gather per step); 2: the gradient accumulator too (a reduce-scatter per "
        "micro-batch); 3: the parameters and gradients too (ZeRO-3 / FSDP: each GPT block "
        "gathered when used, in the forward and again in the backward); shard_map only "
        f"(default: {d.zero_stage})",
    )
    option(
        "--shards",
        metavar="S",
        type=int,
        help="with --zero-stage 3: HSDP (torch's HYBRID_SHARD): the devices form groups of S, "
        "each holding the parameters split over its S devices, and the groups' gradients "
        "are all-reduced once per optimizer step; S divides the device count and, with "
        "several processes, the devices of each process (default: one group of every device)",
    )
    option(
        "--tp",
        metavar="M",
        type=int,
        help="tensor parallelism: M devices of a model axis per data rank, the GPT split over "
        "them by Megatron's plan (whole attention heads and MLP columns, their projections' "
        "rows; M divides its 4 heads), --num-devices data ranks of M devices each (default "
        "--num-devices: every device, M to a rank); --model gpt (the default with --tp), "
        "one process, no --shards (default: 1, none)",
    )
    option(
        "--comm-dtype",
        choices=["bfloat16"],
        help="send the gradient sums in bfloat16 (torch's bf16_compress_hook); accumulation "
        "stays in float32 (default: the accumulator's dtype)",
    )
    option(
        "--epochs",
        metavar="N",
        type=int,
        help=f"train until this epoch (default: {DEFAULT_EPOCHS} without --steps, else no limit)",
    )
    option(
        "--steps",
        metavar="N",
        type=int,
        help="stop after this many optimizer steps (default: none)",
    )


def _checkpoint_options(option: Callable[..., Any], d: TrainConfig) -> None:
    option("--checkpoint-dir", metavar="DIR", help="save checkpoints here (default: none)")
    option(
        "--checkpoint-every",
        metavar="N",
        type=int,
        help="optimizer steps between checkpoints (default: only at the end)",
    )
    option("--keep", metavar="N", type=int, help=f"checkpoints kept (default: {d.keep})")
    option(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir, with its config "
        "for every option not given",
    )
    option(
        "--force-resume",
        action="store_true",
        help="resume even with another global batch size (changes the data order)",
    )


def _output_options(option: Callable[..., Any]) -> None:
    option("--metrics-out", metavar="FILE", help="per-step metrics as JSON lines (default: none)")
    option("--summary-out", metavar="FILE", help="the final summary as JSON (default: none)")
    option(
        "--plot",
        metavar="FILE",
        help="loss (raw and smoothed), held-out accuracy and learning rate as a PNG file "
        "(default: none)",
    )
    option(
        "--tensorboard",
        metavar="DIR",
        help="also write the metrics as TensorBoard event files in DIR (default: none)",
    )
    option(
        "--progress",
        action=argparse.BooleanOptionalAction,
        help="show a progress bar (default: only on a terminal)",
    )


def _run_train(args: argparse.Namespace) -> int:
    # Before anything imports them: one line, not a traceback.
    require_extra(
        "train",
        ["sklearn", "tqdm", "matplotlib", "grain"] + (["tensorboardX"] if args.tensorboard else []),
    )
    try:  # a bad flag: one line before JAX is imported (checked again in _start)
        TrainConfig(**_given(args))
    except ValueError as e:
        print(f"jaxdp train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    import jax

    from .._train_state import NonFiniteError
    from ..checkpoint import CheckpointError
    from ..data import DataChangedError
    from ._launch_link import record_failure
    from ._metrics import say
    from ._train import NonFiniteStep, finish, prepare

    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())  # a resume's corrupt checkpoint
        warnings.showwarning = _show_warning
        # Everything that can refuse the run does so here, before the first step:
        # a usage error, exit status 2 as argparse's own.
        try:
            report = stack.enter_context(compile_cache(args.compile_cache))
            config = _start(args)
            if config.precision == "float64":
                jax.config.update("jax_enable_x64", True)
            files = {"summary_out": args.summary_out}
            prepared = stack.enter_context(prepare(config, files=files))
        except ValueError as e:  # CheckpointError included
            print(f"jaxdp train: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        with _stop_on_signals() as stopped_by:
            try:
                summary = finish(prepared, stop=lambda _: stopped_by[0] is not None)
            except (CheckpointError, NonFiniteError, NonFiniteStep, DataChangedError) as e:
                record_failure(1)  # for jaxdp launch, before the peers can see this end
                print(f"jaxdp train: error: {e}", file=sys.stderr)
                stack.close()  # releases the checkpoint directory's lock
                _exit_now(1)
            except (Exception, KeyboardInterrupt) as e:
                if jax.process_count() == 1 or isinstance(e, KeyboardInterrupt):
                    raise  # a KeyboardInterrupt: main's one line, at once with several
                # Not in JAX's shutdown barrier while the peers block in a collective
                # (under another launcher than jaxdp launch, whose ranks do the same).
                status = 130 if isinstance(e, KeyboardInterrupt) else 1
                record_failure(status)
                traceback.print_exc()
                print(
                    f"jaxdp train: process {jax.process_index()} ends on this "
                    f"{type(e).__name__} at once; its peers stop when they miss its heartbeat",
                    file=sys.stderr,
                )
                _exit_now(status)
        say(report())
    if args.summary_out and jax.process_index() == 0:
        with open(args.summary_out, "w") as f:
            json.dump(summary, f, indent=2)
    # The shell's convention for a process ended by a signal; a process that
    # stopped because a peer process was signalled reports SIGTERM.
    signum = stopped_by[0]
    if signum is None and summary["stopped"]:
        signum = signal.SIGTERM
    return 0 if signum is None else 128 + signum


def _start(args: argparse.Namespace) -> TrainConfig:
    """The run's config (a resume's completed from its checkpoint), once JAX is set up.

    In a group ``jaxdp launch`` restarted (``JAXDP_RESTART_COUNT`` above 0) a run with a
    checkpoint directory resumes without ``--resume``; ``--resume`` where there is no
    checkpoint yet starts a fresh run. Each says so.
    """
    from .._distributed import ENV_CPU_DEVICES, ENV_RESTART_COUNT
    from ._join import join
    from ._metrics import say
    from ._outputs import lock_while
    from ._resume import has_checkpoints, resumed_config, saved_cpu_devices

    given = _given(args)
    config = TrainConfig(**given)
    restart = os.environ.get(ENV_RESTART_COUNT, "0")
    restarted = restart.isdigit() and int(restart) > 0
    if restarted and config.checkpoint_dir is not None and not config.resume:
        given["resume"] = True
        config = dataclasses.replace(config, resume=True)
    # Before JAX starts its backend: the flag, else the launcher's count, else a resumed
    # run's, else the default (CPU only: on a GPU machine the default trains on all GPUs).
    # Under jaxdp launch (or Slurm, ...) join connects the processes, or ends this one.
    cpu_devices = config.cpu_devices
    if cpu_devices is None and not os.environ.get(ENV_CPU_DEVICES):
        if config.resume:
            assert config.checkpoint_dir is not None  # TrainConfig requires it with resume
            cpu_devices = saved_cpu_devices(config.checkpoint_dir)
        if cpu_devices is None:
            cpu_devices = given["cpu_devices"] = DEFAULT_CPU_DEVICES
    join(cpu_devices)
    if cpu_devices is None:  # the launcher's, which initialize has read and checked
        cpu_devices = given["cpu_devices"] = int(os.environ[ENV_CPU_DEVICES])
    config = dataclasses.replace(config, cpu_devices=cpu_devices)
    if restarted:
        what = "resuming from the newest checkpoint"
        if not config.resume:
            what = "training starts over from step 0 (no --checkpoint-dir to resume from)"
        say(f"{ENV_RESTART_COUNT}={restart}: a restarted group; {what}")
    if not config.resume:
        return config
    assert config.checkpoint_dir is not None
    # Reading a checkpoint opens its directory, which clears unfinished saves:
    # not while another run writes there.
    with lock_while(config.checkpoint_dir):
        if not has_checkpoints(config.checkpoint_dir):
            say(f"--resume: no checkpoint in {config.checkpoint_dir} yet; starting a fresh run")
            return dataclasses.replace(config, resume=False)
        resumed, taken = resumed_config(given)
    say(taken)
    if resumed.cpu_devices != cpu_devices:  # the newest readable one is not the one read
        resumed = dataclasses.replace(resumed, cpu_devices=cpu_devices)
    return resumed


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields given on the command line."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if "data" in given:  # saved absolute: a resume from another directory finds the same file
        given["data"] = str(pathlib.Path(given["data"]).resolve())
    return given


def _exit_now(status: int) -> NoReturn:
    """Exits with ``status``, at once with several processes (as jaxdp launch's ranks do on
    an uncaught exception, :mod:`jaxdp.cli._rank`): a failure that reached this process
    alone must not wait in JAX's shutdown barrier."""
    import jax

    if jax.process_count() > 1:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(status)
    raise SystemExit(status)


def _show_warning(message: Warning | str, category: type[Warning], *args: Any, **kw: Any) -> None:
    print(f"jaxdp train: warning: {message}", file=sys.stderr)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[list[int | None]]:
    """Turns the first SIGINT/SIGTERM into a request to stop; the second acts as usual
    (Ctrl-C: the command's end, :mod:`jaxdp.cli._interrupt`)."""
    from ._launch_link import record_failure

    stopped_by: list[int | None] = [None]
    # None: a handler outside Python (JAX's preemption notifier takes SIGTERM).
    previous = {s: signal.getsignal(s) or signal.SIG_DFL for s in (signal.SIGINT, signal.SIGTERM)}
    with lend_sigint() as give_back:

        def request(signum: int, frame: Any) -> None:
            # For jaxdp launch: this process got the signal; its peers, which stop with it
            # at the same call, record theirs when they exit.
            record_failure(128 + signum)
            stopped_by[0] = signum
            print(
                f"\n{signal.Signals(signum).name}: stopping after this micro-batch",
                file=sys.stderr,
            )
            for s, handler in previous.items():
                signal.signal(s, handler)
            give_back(signum)

        for s in previous:
            signal.signal(s, request)
        try:
            yield stopped_by
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


# Per subcommand: its line in "jaxdp --help", and "module:function" (in this package) that
# adds its options and ``run(args) -> status`` to its parser. Only the given command's
# module is imported: "jaxdp --help" and "jaxdp launch" import no JAX, "jaxdp train" no torch.
SUBCOMMANDS = {
    "train": ("train a model on the digits images, data-parallel", "_main:train_arguments"),
    "parity": (
        "train jaxdp and torch_ref (PyTorch DDP + GA) side by side and compare",
        "_parity:add_arguments",
    ),
    "plan": (
        "per-device memory of data-parallel training, and the batch split that fits",
        "_plan:add_arguments",
    ),
    "launch": (
        "run a script or jaxdp subcommand as several processes of one run",
        "_launch:add_arguments",
    ),
    "run": (
        "run a script as one process of a run another launcher started (mpirun, srun)",
        "_run:add_arguments",
    ),
}
# Commands of earlier releases that the installed package no longer has: where they went.
MOVED = {"bench": "jaxdp bench runs from a source checkout: bin/jaxdp bench"}


DESCRIPTION = """\
Data-parallel training with gradient accumulation for JAX, equivalent to
PyTorch DDP with no_sync(): the global batch (num_devices x accum_steps x
micro_batch_size) is split over the devices, and each optimizer step averages
the gradients with one all-reduce.

"jaxdp COMMAND --help" describes a command and its options."""


def version() -> str:
    """``jaxdp 0.3.0 (jax 0.10.2)``: jaxdp's version and the installed jax's."""
    try:
        return f"jaxdp {__version__} (jax {importlib.metadata.version('jax')})"
    except importlib.metadata.PackageNotFoundError:
        return f"jaxdp {__version__} (jax not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``jaxdp`` on ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    As the ``jaxdp`` command (no ``argv``), Ctrl-C ends the process with one line and status
    130, within seconds (:mod:`jaxdp.cli._interrupt`). Called with ``argv`` in a program of
    its own, the program's signal handling stays, and a KeyboardInterrupt ends the command
    with the same line and ``SystemExit(130)``.
    """
    own_process = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    # jaxdp's own options take no value: the first other word names the command.
    given = next((word for word in argv if not word.startswith("-")), None)
    # From the start: building a command's parser imports JAX, where a Ctrl-C is dropped.
    with interruptible(given if given in SUBCOMMANDS else None, own_process) as interrupt:
        try:
            status = _run(argv, given)
        except BaseException as e:  # whatever a Ctrl-C became on its way up
            if interrupt.requested or isinstance(e, KeyboardInterrupt):
                interrupt.end(e)
            raise
        if interrupt.requested:  # the run went on after it: it ends here
            interrupt.end(None)
        return status


def _run(argv: list[str], given: str | None) -> int:
    parser = Parser(prog="jaxdp", description=DESCRIPTION)
    help = "print the versions of jaxdp and jax"
    parser.add_argument("--version", action="version", version=version(), help=help)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (line, where) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=line)
        if name == given:
            module, function = where.split(":")
            getattr(importlib.import_module(f".{module}", __package__), function)(p)
    if argv and argv[0] in MOVED:  # exit status 2, as argparse's for an unknown command
        parser.error(MOVED[argv[0]])
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

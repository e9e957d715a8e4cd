"""The main job: data-parallel training on the digits images (or ``--data``), with
checkpoints.

Read top to bottom: the config, the model and its loss at a precision, then
``train``: mesh and batch identity, the loader (each process's rows of every
call in sampler order, read ahead: :class:`jaxdp.data.Loader`), state (fresh or
resumed, the loader's position with it), the loop, checkpoints, held-out
evaluation.

With several processes (after :func:`jaxdp.initialize`) the same code runs on
each: a process reads only its rows of every batch, all of them write the
checkpoints together (orbax coordinates), and only process 0 prints, shows
progress and writes metrics and plots.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from .._distributed import ENV_LAUNCH_STARTED, ENV_RESTART_COUNT
from .._forward import merge_model
from .._layout import BatchSizes, batch_sizes, epoch_schedule, process_share
from .._mesh import data_mesh
from .._options import Parallel, Skips
from .._position import SamplerPosition
from .._step import TrainStep, make_train_step
from .._train_state import TrainState
from ..checkpoint import Checkpoints
from ..data import Loader, evaluate
from ..models import CNN, MLP
from ._config import Precision, TrainConfig
from ._data import Split, load_digits, load_file
from ._fits import check_fits
from ._metrics import MetricsLog, plot_training
from ._outputs import check_fresh, claimed
from ._run import _Run, _where, say

# ---- model, loss and precision --------------------------------------------------------


def build(config: TrainConfig, data: Split | None = None) -> nnx.Module:
    """The reference model of ``config`` with float64 or float32 parameters, sized
    from ``data`` (:func:`load`'s: the last axis of ``x`` is the MLP's features or the
    CNN's channels; its classes; default: the digits, 64 pixels or 8x8x1 images)."""
    param_dtype = jnp.float64 if config.precision == "float64" else jnp.float32
    rngs = nnx.Rngs(config.seed)
    cnn = config.model == "cnn"
    features, classes = (1 if cnn else 64), 10
    if data is not None:
        features, classes = data.x_train.shape[-1], data.num_classes
    if cnn:
        return CNN(in_channels=features, num_classes=classes, rngs=rngs, param_dtype=param_dtype)
    return MLP(features, config.hidden, classes, rngs=rngs, param_dtype=param_dtype)


def load(config: TrainConfig) -> Split:
    """The run's data: ``config.data`` (a .npz or a directory of .npy) or the digits,
    read as the parameters' dtype (float32 for bfloat16: the forward casts). ``x`` is
    rows of features for the MLP, images ``[n, h, w, channels]`` for the CNN (the digits:
    ``[n, 8, 8, 1]``)."""
    dtype = np.float64 if config.precision == "float64" else np.float32
    if config.data is None:
        return load_digits(seed=config.seed, dtype=dtype, images=config.model == "cnn")
    return load_file(
        config.data,
        model=config.model,
        seed=config.seed,
        dtype=dtype,
        num_classes=config.num_classes,
    )


def forward(model: nnx.Module, x: jax.Array, precision: Precision) -> jax.Array:
    """Logits of ``x`` (as :func:`load` gives it); bfloat16 computes on bfloat16 copies.

    The bfloat16 casts are differentiable, so gradients reach the float32
    parameters in float32 (mixed precision without loss scaling: bfloat16
    has float32's exponent range).
    """
    if precision != "bfloat16":
        return model(x)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    low = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    return nnx.merge(graphdef, low, rest)(x.astype(jnp.bfloat16)).astype(jnp.float32)


def loss_fn(precision: Precision) -> Callable[[nnx.Module, Any], jax.Array]:
    """Mean softmax cross-entropy of one micro-batch ``(x, y)``."""

    def loss(model: nnx.Module, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        x, y = batch
        logits = forward(model, x, precision)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss


def _optimizer(config: TrainConfig) -> optax.GradientTransformation:
    if config.optimizer == "adamw":
        return optax.inject_hyperparams(optax.adamw)(learning_rate=config.learning_rate)
    return optax.inject_hyperparams(optax.sgd)(learning_rate=config.learning_rate, momentum=0.9)


def held_out_accuracy(
    config: TrainConfig, data: Split, fresh: TrainState, mesh: Mesh
) -> Callable[[TrainState], float]:
    """``score(state)``: top-1 accuracy on the held-out rows, data-parallel over
    ``mesh`` (:func:`jaxdp.data.evaluate`: each process reads its devices' rows, the
    counts are summed over devices and processes), ``accum_steps x micro_batch_size``
    rows per device at a time. Compiled once per run (``fresh`` gives the model's
    structure)."""
    graphdef = fresh.graphdef

    def correct(params: Any, batch: tuple[jax.Array, jax.Array]) -> dict[str, jax.Array]:
        x, y = batch
        logits = forward(merge_model(graphdef, *params), x, config.precision)
        return {"accuracy": jnp.argmax(logits, -1) == y}

    rows = config.accum_steps * config.micro_batch_size  # per device, as in training

    def score(state: TrainState) -> float:
        params, source = (state.params, state.model_state), (data.x_test, data.y_test)
        return evaluate(correct, params, source, mesh=mesh, batch_size=rows)["accuracy"]

    return score


# ---- the run ---------------------------------------------------------------------------


def make_step(config: TrainConfig) -> tuple[TrainStep, BatchSizes]:
    """The data-parallel step of ``config`` and its batch identity."""
    if config.precision == "float64" and not jax.config.read("jax_enable_x64"):
        raise ValueError("precision='float64' needs jax_enable_x64 set before training starts")
    there = jax.devices()
    if config.num_devices is not None and config.num_devices > len(there):
        platform = there[0].platform
        hint = " (--cpu-devices sets how many CPU devices to emulate)" if platform == "cpu" else ""
        raise ValueError(
            f"num_devices={config.num_devices} exceeds the {len(there)} {platform} device(s) "
            f"there are{hint}"
        )
    mesh = data_mesh(config.num_devices)
    sizes = batch_sizes(
        num_devices=mesh.devices.size,
        accum_steps=config.accum_steps,
        micro_batch_size=config.micro_batch_size,
    )
    step = make_train_step(
        loss_fn(config.precision),
        _optimizer(config),
        mesh=mesh,
        accum_steps=sizes.accum_steps,
        path=config.path,
        parallel=Parallel(
            zero_stage=config.zero_stage, comm_dtype=config.comm_dtype, strategy=config.strategy
        ),
        skips=Skips(nonfinite=config.skip_nonfinite),
    )
    return step, sizes


def train(
    config: TrainConfig, *, stop: Callable[[SamplerPosition], bool] | None = None
) -> dict[str, Any]:
    """Trains, evaluates on the held-out rows and returns a summary.

    ``stop(position)`` is asked after every call of the step (every
    micro-batch on the ``multisteps`` path); True ends the run there, with a
    checkpoint at that exact position when ``checkpoint_dir`` is set.
    Everything that can refuse the run (a size, a device count, an output path,
    the checkpoint directory's lock, a resume) raises ValueError before the
    first step (:func:`prepare`).
    """
    with prepare(config) as prepared:
        return finish(prepared, stop=stop)


class Prepared(NamedTuple):
    """A run ready for its first step: what :func:`finish` needs."""

    config: TrainConfig
    run: _Run
    data: Split
    log: MetricsLog
    lead: bool  # process 0: prints, plots


@contextlib.contextmanager
def prepare(
    config: TrainConfig, *, files: Mapping[str, str | None] | None = None
) -> Iterator[Prepared]:
    """Mesh, batch identity, outputs and state (fresh or resumed), checked before any step.

    Raises ValueError (a :class:`CheckpointError` for the checkpoints) for
    anything that would stop the run: sizes, devices, a batch larger than the
    data, an output file (``files`` adds option name -> path pairs to the
    config's ``metrics_out`` and ``plot``) whose folder cannot be created or
    written, a checkpoint directory that is not a writable directory or is
    locked by a live run, a checkpoint a resume cannot continue. Holds the
    checkpoint directory's lock until the block ends.
    """
    data = load(config)
    step, sizes = make_step(config)
    mesh, share = step.mesh, process_share(step.mesh, sizes)
    check_fits(config, data, mesh, lambda: build(config, data))  # traced, not built
    lead = share.process_index == 0
    say(
        f"jaxdp train: {config.data or 'digits'} {config.model.upper()} ({config.precision}) "
        f"on {sizes.num_devices} "
        f"{mesh.devices.flat[0].platform} device(s), {len(data.x_train)} train / "
        f"{len(data.x_test)} held-out images"
    )
    if config.data is not None:
        told = "--num-classes" if config.num_classes else "the largest label + 1"
        say(f"classes: {data.num_classes} ({told})")
    say(f"batch: {sizes.describe()}")
    if config.zero_stage or config.comm_dtype:
        split = ("optimizer state", "optimizer state and gradient accumulator")
        zero = f"zero_stage={config.zero_stage}"
        if config.zero_stage:
            zero += f": {split[config.zero_stage - 1]} split over {sizes.num_devices} device(s)"
        say(zero + (f"; gradients sent in {config.comm_dtype}" if config.comm_dtype else ""))
    if share.process_count > 1:
        say(
            f"processes: {share.process_count}, each feeding {share.sizes.global_batch_size} "
            f"rows per step to its {share.sizes.num_devices} device(s)"
        )
    # Raises if one epoch of the data cannot fill an optimizer step.
    epoch_schedule(len(data.x_train), sizes, seed=config.seed)
    # Each process reads its rows of every call ahead of the step, in sampler order.
    loader = Loader(
        (data.x_train, data.y_train),
        sizes,
        mesh=mesh,
        path=config.path,
        seed=config.seed,
        epochs=config.last_epoch,
    )
    outputs = {"metrics_out": config.metrics_out, "plot": config.plot, **(files or {})}
    # Leaving the block stops and joins the loader's threads: the process exits with
    # the run's own status, never the C++ runtime's abort on a thread left running.
    with loader, claimed(outputs, config.checkpoint_dir, tensorboard=config.tensorboard):
        checkpoints = None
        if config.checkpoint_dir is not None:
            checkpoints = Checkpoints(config.checkpoint_dir, keep=config.keep)
        run = _Run(config, step, share, loader, checkpoints)
        run.start(step.init(build(config, data)))
        # A fresh start, also a --resume or a restarted group that found no checkpoint:
        # it refuses another run's records like any new run.
        if run.resumed_step is None:
            check_fresh(outputs, config.tensorboard, own_since=_own_outputs_since())
        metrics_out = config.metrics_out if lead else None
        board = config.tensorboard if lead else None
        with MetricsLog(metrics_out, resume_step=run.resumed_step, tensorboard=board) as log:
            yield Prepared(config, run, data, log, lead)


def _own_outputs_since() -> float | None:
    """In a group ``jaxdp launch`` restarted, when the launch began: outputs written
    since are its earlier starts' (no other run could write them while a start held
    their lock), which a fresh start overwrites. None elsewhere: all are another run's.

    Not the restart count alone: a first start refused for another run's records
    exits 2, and its restart then overwrote them.
    """
    started = os.environ.get(ENV_LAUNCH_STARTED, "")
    if os.environ.get(ENV_RESTART_COUNT, "0") in ("", "0") or not started:
        return None
    try:
        return float(started)
    except ValueError:
        return None  # not the launcher's: refuse as a new run does


def finish(prepared: Prepared, *, stop: Callable[[SamplerPosition], bool] | None) -> dict[str, Any]:
    """Trains a prepared run to its end, checkpoints, evaluates; returns the summary."""
    config, run, data, log, lead = prepared
    start = time.perf_counter()
    score = held_out_accuracy(config, data, run.state, run.step.mesh)
    stopped = run.loop(log, stop, score)
    run.save_final()
    last = log.records[-1] if log.records else {}
    accuracy = last.get("test_accuracy")
    if accuracy is None or last["step"] != int(run.state.step):
        accuracy = score(run.state)  # the run did not end at an epoch's end
    if config.plot and lead:
        plot_training(log.records, config.plot, title=f"jaxdp train: {run.sizes.describe()}")
    summary = {
        "steps": int(run.state.step),
        "samples": run.samples,
        "final_loss": log.records[-1]["loss"] if log.records else None,
        "test_accuracy": accuracy,
        "seconds": time.perf_counter() - start,
        "stopped": stopped,
        "checkpoint": run.last_checkpoint,
    }
    if stopped:  # every process: that they stopped at one place is in their logs
        print(
            f"jaxdp train: process {jax.process_index()} stopped at optimizer step "
            f"{summary['steps']} ({_where(run.position)}); checkpoint {run.last_checkpoint}",
            file=sys.stderr,
        )
    say(
        f"held-out accuracy: {accuracy:.2%} after {summary['steps']} optimizer steps "
        f"({summary['seconds']:.1f} s)" + (" [stopped early]" if stopped else "")
    )
    return summary

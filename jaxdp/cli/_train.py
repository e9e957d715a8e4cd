"""``jaxdp train``: data-parallel training on the digits images (or ``--data``), with
checkpoints, as one script read top to bottom in sections:

1. the config's model (:func:`build`), data (:func:`load`), loss at a precision and
   optimizer;
2. the mesh and the step (:func:`make_step`), with the batch identity;
3. the run (:func:`train` = :func:`prepare`, then :func:`finish`): every check that
   can refuse it, the input pipeline (each process's rows of every call in sampler
   order, read ahead: :class:`jaxdp.data.Loader`), the outputs, the state fresh or
   restored (:meth:`Run.start`);
4. the loop (:meth:`Run.loop`), checkpoints at the exact data position;
5. the end (:func:`finish`): the last checkpoint, held-out accuracy, the summary.

Ideas of their own are imported: reading data files (``_data``), the outputs'
checks and locks (``_outputs``), what a resume may change (``_resume``), whether the
state fits (``_fits``), the metrics log and plot (``_metrics``).

With several processes (after :func:`jaxdp.initialize`) the same code runs on
each: a process reads only its rows of every batch, all of them write the
checkpoints together (orbax coordinates), and only process 0 prints, shows
progress and writes metrics and plots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from .._forward import merge_model
from .._layout import BatchSizes, ProcessShare, batch_sizes, epoch_schedule, process_share
from .._mesh import DATA_AXIS, data_mesh
from .._options import Parallel, Skips
from .._position import SamplerPosition
from .._shards import unpad_params
from .._step import TrainStep, make_train_step
from .._train_state import TrainState
from ..checkpoint import CheckpointError, Checkpoints
from ..data import Batch, DataChangedError, Loader, evaluate
from ..models import CNN, MLP, MODEL_AXIS, ScannedTransformer, with_megatron_plan
from ._config import GPT_HEADS, GPT_LAYERS, Precision, TrainConfig
from ._data import Rows, Split, load_digits, load_file
from ._fits import check_fits
from ._metrics import MetricsLog, agree, plot_training, say
from ._outputs import check_fresh, claimed, own_outputs_since
from ._resume import check_continues

# ---- the config's model, data, loss and optimizer --------------------------------------


# The GPT reads each digit's 64 pixels (0 to 16 in the UCI file) as 64 tokens.
PIXEL_LEVELS = 16


def build(config: TrainConfig, data: Split | None = None) -> nnx.Module:
    """The reference model of ``config`` with float64 or float32 parameters, sized
    from ``data`` (:func:`load`'s: the last axis of ``x`` is the MLP's features or the
    CNN's channels; its classes; default: the digits, 64 pixels or 8x8x1 images).

    ``gpt``: :class:`jaxdp.models.ScannedTransformer`, ``GPT_LAYERS`` blocks stacked
    (one parameter tree at every ZeRO stage) of width ``hidden``, over the 64 pixel
    tokens, with a head to the classes; with ``tp`` above 1, Megatron's plan over the
    model axis in its metadata (:func:`jaxdp.models.with_megatron_plan`).

    Built in one compiled program (``nnx.jit``), which the run's compilation cache keeps:
    built op by op, each of its initializers compiled a program of its own in every
    process (about 1 CPU s of a launch rank's start)."""
    model = nnx.jit(lambda: _built(config, data))()
    return with_megatron_plan(model) if config.tp > 1 else model


def _built(config: TrainConfig, data: Split | None) -> nnx.Module:
    param_dtype = jnp.float64 if config.precision == "float64" else jnp.float32
    rngs = nnx.Rngs(config.seed)
    if config.model == "gpt":
        length = 64 if data is None else data.x_train.shape[-1]
        return ScannedTransformer(
            vocab_size=PIXEL_LEVELS + 1,
            block_size=length,
            d_model=config.hidden,
            n_heads=GPT_HEADS,
            n_layers=GPT_LAYERS,
            num_outputs=10 if data is None else data.num_classes,
            # bfloat16: cast a block at a time inside the loop, after its gather (a cast
            # of the whole model before it, as forward does for the others, would gather
            # every block at once at stage 3).
            dtype=jnp.bfloat16 if config.precision == "bfloat16" else None,
            rngs=rngs,
            param_dtype=param_dtype,
        )
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
    ``[n, 8, 8, 1]``), the digits' pixels as int32 tokens ``[n, 64]`` in ``[0, 16]`` for
    the GPT."""
    dtype = np.float64 if config.precision == "float64" else np.float32
    if config.model == "gpt":  # the config allows the digits only
        pixels = load_digits(seed=config.seed)  # the same split as the MLP's
        tokens = np.rint(pixels.x_train.base * PIXEL_LEVELS).astype(np.int32)
        return pixels._replace(
            x_train=Rows(tokens, pixels.x_train.index, np.int32),
            x_test=Rows(tokens, pixels.x_test.index, np.int32),
        )
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
    """Logits of ``x`` (as :func:`load` gives it); bfloat16 computes on bfloat16 copies
    (the GPT casts its own, a block at a time: :func:`build`). The GPT's logits are its
    last position's (the one that attends to every pixel).

    The bfloat16 casts are differentiable, so gradients reach the float32
    parameters in float32 (mixed precision without loss scaling: bfloat16
    has float32's exponent range).
    """
    if precision == "bfloat16" and not isinstance(model, ScannedTransformer):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        low = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        model, x = nnx.merge(graphdef, low, rest), x.astype(jnp.bfloat16)
    logits = model(x)
    if precision == "bfloat16":
        logits = logits.astype(jnp.float32)
    return logits[:, -1] if isinstance(model, ScannedTransformer) else logits


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


# ---- the mesh and the step -------------------------------------------------------------


def make_step(config: TrainConfig) -> tuple[TrainStep, BatchSizes]:
    """The data-parallel step of ``config`` and its batch identity; with ``tp`` above 1
    on a ``(data, model)`` mesh of ``num_devices`` data ranks (default: all the devices
    there are, ``tp`` to a rank) of ``tp`` devices each."""
    if config.precision == "float64" and not jax.config.read("jax_enable_x64"):
        raise ValueError("precision='float64' needs jax_enable_x64 set before training starts")
    mesh = _mesh(config)
    sizes = batch_sizes(
        num_devices=mesh.shape[DATA_AXIS],
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
            zero_stage=config.zero_stage,
            comm_dtype=config.comm_dtype,
            strategy=config.strategy,
            shards=config.shards,
            model_axes=(MODEL_AXIS,) if config.tp > 1 else (),
        ),
        skips=Skips(nonfinite=config.skip_nonfinite),
    )
    return step, sizes


def _mesh(config: TrainConfig) -> Mesh:
    """A data mesh of ``num_devices``, or with ``tp`` the ``(data, model)`` mesh of
    ``num_devices`` data ranks of ``tp`` consecutive devices (a rank's devices in one
    process, as ``jaxdp parity --tp`` lays them); refuses more devices than there are."""
    there, tp = jax.devices(), config.tp
    platform = there[0].platform
    hint = " (--cpu-devices sets how many CPU devices to emulate)" if platform == "cpu" else ""
    if config.num_devices is not None and config.num_devices * tp > len(there):
        times = f" x tp={tp}" if tp > 1 else ""
        raise ValueError(
            f"num_devices={config.num_devices}{times} exceeds the {len(there)} {platform} "
            f"device(s) there are{hint}"
        )
    if tp == 1:
        return data_mesh(config.num_devices)
    if config.num_devices is None and len(there) % tp:
        raise ValueError(
            f"tp={tp} must divide the {len(there)} {platform} device(s) there are (without "
            f"num_devices every device trains, tp to a data rank){hint}"
        )
    if jax.process_count() > 1:
        raise ValueError(
            f"tp={tp} with {jax.process_count()} processes: jaxdp train's loader and held-out "
            "evaluation place rows one device per data rank (jaxdp.data takes no model axis "
            "yet); run --tp in one process"
        )
    ranks = config.num_devices or len(there) // tp
    devices = np.array(there[: ranks * tp]).reshape(ranks, tp)
    auto = (jax.sharding.AxisType.Auto,) * 2
    return Mesh(devices, (DATA_AXIS, MODEL_AXIS), axis_types=auto)


def rows_mesh(mesh: Mesh) -> Mesh:
    """Where the loader and the held-out evaluation place rows: ``mesh``, or a
    ``(data, model)`` mesh's first device of each data rank (:mod:`jaxdp.data` takes no
    model axis yet; the loop copies each call's rows to the rank's other devices)."""
    if MODEL_AXIS not in mesh.axis_names:
        return mesh
    return Mesh(mesh.devices[:, 0], (DATA_AXIS,))  # _mesh's (data, model) order


# ---- the run: checked, input pipeline, outputs, state (fresh or restored) --------------


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
    run: Run
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
    step, sizes = make_step(config)  # the mesh, the step, the batch identity
    mesh, share = step.mesh, process_share(step.mesh, sizes, model_axes=step.options.model_axes)
    check_fits(config, data, mesh, lambda: build(config, data))  # traced, not built
    lead = share.process_index == 0
    # What the run is, its derived sizes included, said once at its start.
    say(
        f"jaxdp train: {config.data or 'digits'} {config.model.upper()} ({config.precision}) "
        f"on {mesh.devices.size} "
        f"{mesh.devices.flat[0].platform} device(s), {len(data.x_train)} train / "
        f"{len(data.x_test)} held-out images"
    )
    if config.tp > 1:
        say(
            f"tensor parallelism: {sizes.num_devices} data rank(s) of tp={config.tp} devices "
            "on a model axis, each rank's GPT split over its devices (Megatron's plan: whole "
            "attention heads and MLP columns, their projections' rows)"
        )
    if config.data is not None:
        told = "--num-classes" if config.num_classes else "the largest label + 1"
        say(f"classes: {data.num_classes} ({told})")
    say(f"batch: {sizes.describe()}")
    if config.zero_stage or config.comm_dtype:
        split = (
            "optimizer state",
            "optimizer state and gradient accumulator",
            "parameters, gradients, gradient accumulator and optimizer state",
        )
        zero = f"zero_stage={config.zero_stage}"
        if config.zero_stage:
            over = f"{sizes.num_devices} device(s)"
            if config.tp > 1:  # each device's block of its own model shard
                over = f"{sizes.num_devices} data rank(s)"
            if config.shards and config.shards < sizes.num_devices:
                over = (
                    f"each of {sizes.num_devices // config.shards} shard groups of "
                    f"{config.shards} device(s), the groups' gradients all-reduced once per "
                    "step (HSDP)"
                )
            zero += f": {split[config.zero_stage - 1]} split over {over}"
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
        mesh=rows_mesh(mesh),
        path=config.path,
        seed=config.seed,
        epochs=config.last_epoch,
    )
    outputs = {"metrics_out": config.metrics_out, "plot": config.plot, **(files or {})}
    # Leaving the block stops and joins the loader's threads: the process exits with
    # the run's own status, never the C++ runtime's abort on a thread left running.
    with loader, claimed(outputs, config.checkpoint_dir, tensorboard=config.tensorboard):
        # The state: fresh, or restored from the newest checkpoint with the loader's position.
        checkpoints = None
        if config.checkpoint_dir is not None:
            checkpoints = Checkpoints(config.checkpoint_dir, keep=config.keep)
        run = Run(config, step, share, loader, checkpoints)
        run.start(step.init(build(config, data)))
        # A fresh start, also a --resume or a restarted group that found no checkpoint:
        # it refuses another run's records like any new run.
        if run.resumed_step is None:
            check_fresh(outputs, config.tensorboard, own_since=own_outputs_since())
        metrics_out = config.metrics_out if lead else None
        board = config.tensorboard if lead else None
        with MetricsLog(metrics_out, resume_step=run.resumed_step, tensorboard=board) as log:
            yield Prepared(config, run, data, log, lead)


# ---- restore, the loop, checkpoints ----------------------------------------------------


class NonFiniteStep(RuntimeError):
    """Without skipping, an update with a NaN or Inf loss or gradient was applied: the run
    stops there (``jaxdp train --no-skip-nonfinite``)."""


class Run:
    """The moving parts of one run: state, sampler position, checkpoints; restored by
    :meth:`start`, trained by :meth:`loop`, saved by :meth:`save`."""

    def __init__(
        self,
        config: TrainConfig,
        step: TrainStep,
        share: ProcessShare,
        loader: Loader,
        checkpoints: Checkpoints | None,
    ):
        self.config, self.step, self.share, self.loader = config, step, share, loader
        self.sizes, self.steps_per_epoch = loader.sizes, loader.steps_per_epoch
        self.checkpoints = checkpoints
        self.position = SamplerPosition(0, 0, 0)
        self.samples = 0  # training samples consumed
        self.resumed_step: int | None = None
        self.last_checkpoint: str | None = None
        # (position, samples) of last_checkpoint, the newest in the directory.
        self.checkpointed: tuple[SamplerPosition, int] | None = None
        self.state: Any = None

    # ---- restore

    def start(self, fresh: Any) -> None:
        """Takes the fresh state, or the newest readable checkpoint with ``resume``
        (which sets the loader to continue at the checkpoint's rows)."""
        self.state = fresh
        if self.checkpoints is None:
            return
        if not self.config.resume:
            if self.checkpoints.steps:
                raise CheckpointError(
                    f"checkpoint_dir={self.config.checkpoint_dir!r} already holds checkpoints "
                    f"{self.checkpoints.steps}; resume from the newest (--resume) or choose "
                    "another directory (checkpoints are never overwritten)"
                )
            return
        restored = self.checkpoints.restore(
            fresh,
            data=self.loader,
            force=self.config.force_resume,
            validate=lambda extra: check_continues(self.config, extra),
        )
        self.state, self.samples = restored.state, self.loader.samples
        self.resumed_step = int(restored.state.step)
        self.position = self.loader.position
        self.last_checkpoint = str(restored.path)
        self.checkpointed = (self.position, self.samples)
        say(f"resumed from {restored.path}: step {self.resumed_step}, {_where(self.position)}")
        if restored.sizes != self.sizes:
            say(f"  the checkpoint's batch was {restored.sizes.describe()}")

    # ---- the loop

    def loop(
        self,
        log: MetricsLog,
        stop: Callable[[SamplerPosition], bool] | None,
        score: Callable[[Any], float] | None = None,
    ) -> bool:
        """Trains from the loader's position; True if ``stop`` ended the run.

        At the end of every epoch ``score(state)`` (held-out accuracy, a collective
        over the processes) goes into that step's record as ``test_accuracy``.

        With several processes, ``stop`` is asked on each and the run ends on
        all of them after the first call where any says True.
        """
        steps = self.config.steps
        progress = _Progress(done=int(self.state.step))  # then read once per update
        if steps is not None and progress.done >= steps:
            return False
        # None: tqdm's own choice, a bar on a terminal only.
        disable = None if self.config.progress is None else not self.config.progress
        if self.share.process_index != 0:
            disable = True
        bar = tqdm(total=self._total_steps(), initial=progress.done, unit="step", disable=disable)
        with bar:
            # The loader's position moves as it hands out a batch: the loop ends after
            # a step, never holding a batch it will not train on (the checkpoint's rows).
            try:
                for batch in self.loader:
                    if self.loader.mesh is not self.step.mesh:  # rows_mesh's: to each device
                        rows = NamedSharding(self.step.mesh, P(DATA_AXIS))
                        batch = batch._replace(data=jax.device_put(batch.data, rows))
                    self.state, metrics = self.step(self.state, batch)  # checks its sizes
                    self.position, self.samples = batch.position, self.loader.samples
                    if batch.emits:
                        self._updated(batch, metrics, progress, log, bar, score)
                    if stop is not None and agree(stop(batch.position)):
                        return True
                    if steps is not None and progress.done >= steps:
                        break
            except DataChangedError:
                # What was trained on the data as they were is kept. With several
                # processes a peer may not have seen the change yet: a checkpoint
                # (collective) could wait for it forever, so the last one stands.
                if self.share.process_count == 1:
                    self.save()
                raise
        self.step.check(self.state)  # a skip limit reached by the last call
        return False

    def _total_steps(self) -> int:
        """The progress bar's total: ``steps``, or ``last_epoch``'s, whichever ends first."""
        config = self.config
        total = config.steps or (config.last_epoch or 0) * self.steps_per_epoch
        if config.steps and config.last_epoch:
            total = min(total, config.last_epoch * self.steps_per_epoch)
        return total

    def _updated(
        self,
        batch: Batch,
        metrics: dict[str, Any],
        progress: _Progress,
        log: MetricsLog,
        bar: tqdm,
        score: Callable[[Any], float] | None,
    ) -> None:
        """After a call that ended a window: the metrics line, the held-out score at an
        epoch's end, the progress bar, the non-finite report and the checkpoint."""
        record = _record(self.state, metrics, batch.epoch, self.samples)  # waits
        # A skipped (non-finite) update leaves the step count as it was.
        advanced, progress.done = record["step"] > progress.done, record["step"]
        now = time.perf_counter()
        # The clock starts after the first update: it includes compiling.
        if progress.clock is None:
            progress.clock = (now, self.samples)
        else:
            since, samples = progress.clock
            record["samples_per_s"] = (self.samples - samples) / (now - since)
        epoch_end = batch.position.step_in_epoch == 0
        if epoch_end and score is not None:
            record["test_accuracy"] = progress.accuracy = score(self.state)
        bar.set_postfix(_postfix(record, progress.accuracy), refresh=False)
        log.write(record)
        bar.update()
        if not _finite(record):  # already on the host: no sync of its own
            self._nonfinite(record)
        every = self.config.checkpoint_every
        if every and advanced and progress.done % every == 0:
            self.save()
        if bar.disable and epoch_end:
            say(_epoch_line(record))

    def _nonfinite(self, record: dict[str, Any]) -> None:
        """Reports a skipped update; without skipping, stops the run naming the step."""
        values = f"loss={record['loss']}, grad_norm={record.get('grad_norm')}"
        newest = "no checkpoint was saved"
        if self.last_checkpoint:
            newest = f"the newest checkpoint is {self.last_checkpoint}"
        if record.get("skipped"):
            limit = self.step.options.skips.max_consecutive
            skips = int(record["consecutive_skips"])
            self._tell(
                f"optimizer step {record['step'] + 1} (epoch {record['epoch']}): non-finite "
                f"{values}; update skipped ({skips} in a row; "
                f"max_consecutive_skips={limit} ends the run)"
            )
            # Here, where every step's record is read anyway, exactly at the limit (the
            # step's own watch may let up to two more calls run before it raises).
            if limit is not None and skips >= limit:
                raise NonFiniteStep(
                    f"{skips} optimizer steps in a row (the last in epoch {record['epoch']}) "
                    f"had a non-finite loss or gradients and were skipped: stopped, "
                    f"parameters as after step {record['step']}; {newest}. NaN or Inf in "
                    "the data (x is checked at start up to 256 MB) or a learning rate too "
                    "high are the usual causes"
                )
            return
        raise NonFiniteStep(
            f"optimizer step {record['step']} (epoch {record['epoch']}) had a non-finite "
            f"{values}, and with skip_nonfinite off (--no-skip-nonfinite) its update made "
            f"the parameters non-finite: stopped there, nothing saved after it; {newest}. "
            "Resume with skipping on, or a lower learning rate"
        )

    # ---- checkpoints

    def save(self) -> None:
        """A checkpoint at the current position, unless its step number is taken.

        Checkpoints are numbered by optimizer step, so a stop inside an
        accumulation window (multisteps) meets the checkpoint of the window's
        start if one was taken: that one stays, and a resume from it redoes
        the micro-batches since, exactly (the data order is deterministic).
        """
        if self.checkpoints is None:
            return
        number = int(self.state.step)
        if number in self.checkpoints.steps:
            if self.checkpointed is not None and self.checkpointed[0] != self.position:
                self._tell(self._not_saved(number))
            return  # else it is this very position's, just saved or resumed from
        path = self.checkpoints.save(
            self.state,
            data=self.loader,  # its position, batch identity and data set's order
            samples=self.samples,
            seed=self.config.seed,
            extra={"config": dataclasses.asdict(self.config)},
        )
        self.last_checkpoint = str(path)
        self.checkpointed = (self.position, self.samples)
        self._tell(f"checkpoint {path}: step {number}, {_where(self.position)}")

    def _not_saved(self, number: int) -> str:
        assert self.checkpointed is not None  # a number is taken only by this run's newest
        at, samples = self.checkpointed
        since = (self.samples - samples) // (self.sizes.num_devices * self.sizes.micro_batch_size)
        taken = f"an earlier call ({_where(at)})"
        if at == self.position._replace(micro_batch=0):
            taken = "the start of this accumulation window"
        return (
            f"no checkpoint at this stop ({_where(self.position)}): {self.last_checkpoint} "
            f"holds step {number} already, taken at {taken}; a resume from it redoes the "
            f"{since} micro-batch(es) since, exactly (the data order is deterministic)"
        )

    def _tell(self, text: str) -> None:
        """A line on process 0 that leaves the progress bar intact."""
        if self.share.process_index == 0:
            tqdm.write(text)

    def save_final(self) -> None:
        """A checkpoint where the run ended, unless one was just taken there."""
        self.save()


# ---- the end: the last checkpoint, held-out accuracy, the summary ----------------------


def held_out_accuracy(
    config: TrainConfig, data: Split, fresh: TrainState, mesh: Mesh
) -> Callable[[TrainState], float]:
    """``score(state)``: top-1 accuracy on the held-out rows, data-parallel over
    ``mesh`` (:func:`jaxdp.data.evaluate`: each process reads its devices' rows, the
    counts are summed over devices and processes), ``accum_steps x micro_batch_size``
    rows per device at a time. Compiled once per run (``fresh`` gives the model's
    structure)."""
    graphdef, logical = fresh.graphdef, fresh.logical

    def correct(params: Any, batch: tuple[jax.Array, jax.Array]) -> dict[str, jax.Array]:
        x, y = batch
        # Stage 3's padded leaves in the model's shapes (sliced inside the compiled call).
        params = (unpad_params(params[0], logical), params[1])
        logits = forward(merge_model(graphdef, *params), x, config.precision)
        return {"accuracy": jnp.argmax(logits, -1) == y}

    rows = config.accum_steps * config.micro_batch_size  # per device, as in training

    # With a model axis, the parameters whole on each data rank's first device.
    evaluated = rows_mesh(mesh)

    def score(state: TrainState) -> float:
        params, source = (state.params, state.model_state), (data.x_test, data.y_test)
        if evaluated is not mesh:
            params = jax.device_put(params, NamedSharding(evaluated, P()))
        return evaluate(correct, params, source, mesh=evaluated, batch_size=rows)["accuracy"]

    return score


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


# ---- what the loop carries and writes --------------------------------------------------


@dataclasses.dataclass
class _Progress:
    """What the loop carries from one update to the next."""

    done: int  # updates applied
    clock: tuple[float, int] | None = None  # (time, samples) after the first update
    accuracy: float | None = None  # held-out, at the last epoch's end


def _where(position: SamplerPosition) -> str:
    text = f"next: epoch {position.epoch} batch {position.step_in_epoch}"
    return text + (f" micro-batch {position.micro_batch}" if position.micro_batch else "")


def _postfix(record: dict[str, Any], accuracy: float | None) -> dict[str, str]:
    """The progress bar's numbers: loss, held-out accuracy (last epoch's), lr, samples/s."""
    shown = {"loss": f"{record['loss']:.4f}"}
    if accuracy is not None:
        shown["acc"] = f"{accuracy:.2%}"
    if "learning_rate" in record:
        shown["lr"] = f"{record['learning_rate']:.3g}"
    if record["samples_per_s"] is not None:
        shown["samples_s"] = f"{record['samples_per_s']:.0f}"
    return shown


def _epoch_line(record: dict[str, Any]) -> str:
    """The plain output's line at an epoch's end (no progress bar)."""
    line = f"epoch {record['epoch']} done: step {record['step']} loss {record['loss']:.4f}"
    if "test_accuracy" in record:
        line += f", held-out accuracy {record['test_accuracy']:.2%}"
    if "learning_rate" in record:
        line += f", learning rate {record['learning_rate']:.3g}"
    return line


def _finite(record: dict[str, Any]) -> bool:
    return all(math.isfinite(record.get(k, 0.0)) for k in ("loss", "grad_norm"))


def _record(state: Any, metrics: dict[str, Any], epoch: int, samples: int) -> dict[str, Any]:
    """One metrics line; ``samples_per_s`` (from the second update on) is added by the loop."""
    return {
        "step": int(state.step),
        "epoch": epoch,
        "samples": samples,
        "samples_per_s": None,
        **{k: float(v) for k, v in metrics.items() if k != "emitted"},
    }

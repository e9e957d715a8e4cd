"""The main job: data-parallel training on the digits images, with checkpoints.

Read top to bottom: the config, the model and its loss at a precision, then
``train``: mesh and batch identity, state (fresh or resumed), the loop over
micro-batch calls in sampler order, checkpoints, held-out evaluation.

With several processes (after :func:`jaxdp.initialize`) the same code runs on
each: a process reads only its rows of every batch, all of them write the
checkpoints together (orbax coordinates), and only process 0 prints, shows
progress and writes metrics and plots.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from ._checkpoint import Checkpoints
from ._data import load_digits
from ._layout import (
    BatchSizes,
    ProcessShare,
    batch_sizes,
    epoch_batches,
    micro_batches,
    process_share,
)
from ._mesh import data_mesh
from ._metrics import MetricsLog, agree, plot_loss, sum_over_processes
from ._models import CNN, MLP
from ._resume import CheckpointError, SamplerPosition, resume_position
from ._step import AccumulationPath, Strategy, TrainStep, make_train_step

Precision = Literal["float32", "float64", "bfloat16"]
DEFAULT_EPOCHS = 15  # when neither epochs nor steps is given

# Fields a resumed run must share with the checkpoint's, and why.
RESUME_FIXED = {
    "model": "the parameters would not fit",
    "hidden": "the parameters would not fit",
    "precision": "the parameter and compute dtypes would change",
    "optimizer": "the optimizer state would not fit",
    "learning_rate": "the optimizer state holds the learning rate",
    "path": "the accumulation path decides the optimizer state's layout",
    "seed": "the seed fixes the held-out split and every epoch's data order",
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: str = "mlp"  # "mlp" (64-hidden-hidden-10) or "cnn" (on the 8x8x1 images)
    num_devices: int | None = None  # data-parallel devices; None: all there are
    accum_steps: int = 2  # micro-batches per device per optimizer step
    micro_batch_size: int = 16  # rows per micro-batch per device
    epochs: int | None = None  # last epoch (exclusive); None: 15, or no limit with steps
    steps: int | None = None  # stop after this many optimizer steps in all; None: no limit
    optimizer: str = "adamw"  # "adamw" or "sgd" (momentum 0.9)
    learning_rate: float = 3e-3
    path: AccumulationPath = "fused"  # "fused" or "multisteps"
    strategy: Strategy = "shard_map"  # "shard_map" or "pmap"
    precision: Precision = "float32"  # bfloat16: bfloat16 compute, float32 parameters
    hidden: int = 128  # width of the MLP's hidden layers
    seed: int = 0  # model init, held-out split, data order
    checkpoint_dir: str | None = None  # where checkpoints go; None: none
    checkpoint_every: int | None = None  # optimizer steps between checkpoints; None: at the end
    keep: int = 3  # checkpoints kept (the newest verified ones)
    resume: bool = False  # continue from the newest readable checkpoint in checkpoint_dir
    force_resume: bool = False  # resume even with another global_batch_size
    metrics_out: str | None = None  # JSON lines file, one record per optimizer step
    plot: str | None = None  # PNG of the loss curve
    progress: bool | None = None  # progress bar; None: only on a terminal

    def __post_init__(self) -> None:
        for name in ("epochs", "steps", "checkpoint_every", "keep", "hidden"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name, allowed in (
            ("model", ("mlp", "cnn")),
            ("optimizer", ("adamw", "sgd")),
            ("precision", ("float32", "float64", "bfloat16")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        for name in ("resume", "checkpoint_every"):
            if getattr(self, name) and self.checkpoint_dir is None:
                raise ValueError(f"{name}={getattr(self, name)!r} needs a checkpoint_dir")
        if self.plot is not None and not self.plot.endswith(".png"):
            raise ValueError(f"plot={self.plot!r} must name a .png file")

    @property
    def last_epoch(self) -> int | None:
        if self.epochs is None and self.steps is None:
            return DEFAULT_EPOCHS
        return self.epochs


# ---- model, loss and precision --------------------------------------------------------


def build(config: TrainConfig) -> nnx.Module:
    """The reference model of ``config`` with float64 or float32 parameters."""
    param_dtype = jnp.float64 if config.precision == "float64" else jnp.float32
    rngs = nnx.Rngs(config.seed)
    if config.model == "cnn":
        return CNN(in_channels=1, num_classes=10, rngs=rngs, param_dtype=param_dtype)
    return MLP(64, config.hidden, 10, rngs=rngs, param_dtype=param_dtype)


def forward(model: nnx.Module, x: jax.Array, precision: Precision) -> jax.Array:
    """Logits of images ``x`` (``[n, 64]``); bfloat16 computes on bfloat16 copies.

    The bfloat16 casts are differentiable, so gradients reach the float32
    parameters in float32 (mixed precision without loss scaling: bfloat16
    has float32's exponent range).
    """
    if isinstance(model, CNN):
        x = x.reshape(-1, 8, 8, 1)
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


def evaluate(model: nnx.Module, x: np.ndarray, y: np.ndarray, precision: Precision) -> float:
    """Top-1 accuracy of ``model`` on ``x``.

    With several processes each scores rows ``p::process_count`` on its own
    copy of the model, and the counts are summed across processes.
    """
    p, count = jax.process_index(), jax.process_count()
    x, y = x[p::count], y[p::count]
    logits = nnx.jit(lambda m, x: forward(m, x, precision))(model, jnp.asarray(x))
    correct = int(np.sum(np.argmax(np.asarray(logits), -1) == y))
    correct, total = sum_over_processes(np.array([correct, len(y)]))
    return float(correct / total)


# ---- the run ---------------------------------------------------------------------------


def make_step(config: TrainConfig) -> tuple[TrainStep, BatchSizes]:
    """The data-parallel step of ``config`` and its batch identity."""
    if config.precision == "float64" and not jax.config.read("jax_enable_x64"):
        raise ValueError("precision='float64' needs jax_enable_x64 set before training starts")
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
        strategy=config.strategy,
    )
    return step, sizes


def train(
    config: TrainConfig, *, stop: Callable[[SamplerPosition], bool] | None = None
) -> dict[str, Any]:
    """Trains, evaluates on the held-out rows and returns a summary.

    ``stop(position)`` is asked after every call of the step (every
    micro-batch on the ``multisteps`` path); True ends the run there, with a
    checkpoint at that exact position when ``checkpoint_dir`` is set.
    """
    data = load_digits(seed=config.seed)
    step, sizes = make_step(config)
    mesh, share = step.mesh, process_share(step.mesh, sizes)
    lead = share.process_index == 0
    say(
        f"jaxdp train: digits {config.model.upper()} ({config.precision}) on {sizes.num_devices} "
        f"{mesh.devices.flat[0].platform} device(s), {len(data.x_train)} train / "
        f"{len(data.x_test)} held-out images"
    )
    say(f"batch: {sizes.describe()}")
    if share.process_count > 1:
        say(
            f"processes: {share.process_count}, each feeding {share.sizes.global_batch_size} "
            f"rows per step to its {share.sizes.num_devices} device(s)"
        )
    steps_per_epoch = len(epoch_batches(len(data.x_train), sizes, seed=config.seed))
    checkpoints = None
    if config.checkpoint_dir is not None:
        checkpoints = Checkpoints(config.checkpoint_dir, keep=config.keep)
    run = _Run(config, step, sizes, share, steps_per_epoch, checkpoints)
    run.start(step.init(build(config)))
    start = time.perf_counter()
    metrics_out = config.metrics_out if lead else None
    with MetricsLog(metrics_out, resume_step=run.resumed_step) as log:
        x = data.x_train.astype(np.float64 if config.precision == "float64" else np.float32)
        stopped = run.loop(x, data.y_train, log, stop)
    run.save_final()
    # Each process scores its own copy of the (replicated) model.
    params, rest = jax.tree.map(
        lambda a: np.asarray(a.addressable_data(0)), (run.state.params, run.state.model_state)
    )
    model = step.model(run.state._replace(params=params, model_state=rest))
    accuracy = evaluate(model, data.x_test, data.y_test, config.precision)
    if config.plot and lead:
        plot_loss(log.records, config.plot, title=f"jaxdp train: {sizes.describe()}")
    summary = {
        "steps": int(run.state.step),
        "samples": run.samples,
        "final_loss": log.records[-1]["loss"] if log.records else None,
        "test_accuracy": accuracy,
        "seconds": time.perf_counter() - start,
        "stopped": stopped,
        "checkpoint": run.last_checkpoint,
    }
    say(
        f"held-out accuracy: {accuracy:.2%} after {summary['steps']} optimizer steps "
        f"({summary['seconds']:.1f} s)" + (" [stopped early]" if stopped else "")
    )
    return summary


def say(*args: Any) -> None:
    """``print`` on process 0 only."""
    if jax.process_index() == 0:
        print(*args)


class _Run:
    """The moving parts of one run: state, sampler position, checkpoints."""

    def __init__(
        self,
        config: TrainConfig,
        step: TrainStep,
        sizes: BatchSizes,
        share: ProcessShare,
        steps_per_epoch: int,
        checkpoints: Checkpoints | None,
    ):
        self.config, self.step, self.sizes, self.share = config, step, sizes, share
        self.steps_per_epoch = steps_per_epoch
        self.checkpoints = checkpoints
        self.position = SamplerPosition(0, 0, 0)
        self.samples = 0  # training samples consumed (checkpoints are numbered by it)
        self.resumed_step: int | None = None
        self.last_checkpoint: str | None = None
        self.state: Any = None

    def start(self, fresh: Any) -> None:
        """Takes the fresh state, or the newest readable checkpoint with ``resume``."""
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
            fresh, sizes=self.sizes, force=self.config.force_resume, validate=self._validate
        )
        self.state, self.samples = restored.state, restored.samples
        self.resumed_step = int(restored.state.step)
        self.position = resume_position(
            restored.position,
            saved=restored.sizes,
            sizes=self.sizes,
            steps_per_epoch=self.steps_per_epoch,
        )
        self.last_checkpoint = str(restored.path)
        say(f"resumed from {restored.path}: step {self.resumed_step}, {_where(self.position)}")
        if restored.sizes != self.sizes:
            say(f"  the checkpoint's batch was {restored.sizes.describe()}")

    def _validate(self, extra: dict[str, Any]) -> None:
        saved = extra.get("config", {})
        for name, reason in RESUME_FIXED.items():
            if saved.get(name) != getattr(self.config, name):
                raise CheckpointError(
                    f"the checkpoint was trained with {name}={saved.get(name)!r}; this run has "
                    f"{name}={getattr(self.config, name)!r} ({reason})"
                )

    def loop(
        self,
        x: np.ndarray,
        y: np.ndarray,
        log: MetricsLog,
        stop: Callable[[SamplerPosition], bool] | None,
    ) -> bool:
        """Trains from ``self.position``; True if ``stop`` ended the run.

        With several processes, ``stop`` is asked on each and the run ends on
        all of them after the first call where any says True.
        """
        config, every = self.config, self.config.checkpoint_every
        total = config.steps or (config.last_epoch or 0) * self.steps_per_epoch
        if config.steps and config.last_epoch:
            total = min(total, config.last_epoch * self.steps_per_epoch)
        clock: tuple[float, int] | None = None  # (time, samples) after the first update
        disable = None if config.progress is None else not config.progress
        if self.share.process_index != 0:
            disable = True
        done = int(self.state.step)  # updates applied; then read once per update, not per call
        with tqdm(total=total, initial=done, unit="step", disable=disable) as bar:
            for call, epoch, position, emitted in self._calls(x, y):
                if config.steps is not None and done >= config.steps:
                    break
                self.state, metrics = self.step(self.state, call)
                self.samples += len(call[1]) * self.share.process_count
                self.position = position
                if emitted:
                    record = _record(self.state, metrics, epoch, self.samples)  # waits for it
                    done = record["step"]
                    now = time.perf_counter()
                    # The clock starts after the first update: it includes compiling.
                    if clock is None:
                        clock = (now, self.samples)
                    else:
                        rate = (self.samples - clock[1]) / (now - clock[0])
                        record["samples_per_s"] = rate
                        bar.set_postfix(loss=f"{record['loss']:.4f}", samples_s=f"{rate:.0f}")
                    log.write(record)
                    bar.update()
                    if every and record["step"] % every == 0:
                        self.save()
                    if bar.disable and position.step_in_epoch == 0:
                        say(f"epoch {epoch} done: step {record['step']} loss {record['loss']:.4f}")
                if stop is not None and agree(stop(position)):
                    return True
        self.step.check(self.state)  # a skip limit reached by the last call
        return False

    def _calls(
        self, x: np.ndarray, y: np.ndarray
    ) -> Iterator[tuple[Any, int, SamplerPosition, bool]]:
        """``(call, epoch, position after it, emits an update)`` in sampler order, from here.

        A call holds this process's rows only (all rows with one process).
        """
        at, last_epoch = self.position, self.config.last_epoch
        epoch = at.epoch
        while last_epoch is None or epoch < last_epoch:
            order = epoch_batches(len(x), self.sizes, epoch=epoch, seed=self.config.seed)
            for i in range(at.step_in_epoch if epoch == at.epoch else 0, len(order)):
                mine = order[i][self.share.rows]
                batch = (x[mine], y[mine])
                fused = self.config.path == "fused"
                calls = [batch] if fused else micro_batches(batch, self.share.sizes)
                for j in range(at.micro_batch if (epoch, i) == at[:2] else 0, len(calls)):
                    if j + 1 < len(calls):
                        after = SamplerPosition(epoch, i, j + 1)
                    elif i + 1 < len(order):
                        after = SamplerPosition(epoch, i + 1, 0)
                    else:
                        after = SamplerPosition(epoch + 1, 0, 0)
                    yield calls[j], epoch, after, j + 1 == len(calls)
            epoch += 1

    def save(self) -> None:
        """A checkpoint at the current position."""
        if self.checkpoints is None:
            return
        path = self.checkpoints.save(
            self.state,
            position=self.position,
            sizes=self.sizes,
            samples=self.samples,
            seed=self.config.seed,
            extra={"config": dataclasses.asdict(self.config)},
        )
        self.last_checkpoint = str(path)
        if self.share.process_index == 0:
            tqdm.write(f"checkpoint {path}: step {int(self.state.step)}, {_where(self.position)}")

    def save_final(self) -> None:
        """A checkpoint where the run ended, unless one was just taken there."""
        if self.checkpoints is not None and self.samples not in self.checkpoints.steps:
            self.save()


def _where(position: SamplerPosition) -> str:
    text = f"next: epoch {position.epoch} batch {position.step_in_epoch}"
    return text + (f" micro-batch {position.micro_batch}" if position.micro_batch else "")


def _record(state: Any, metrics: dict[str, Any], epoch: int, samples: int) -> dict[str, Any]:
    """One metrics line; ``samples_per_s`` (from the second update on) is added by the loop."""
    return {
        "step": int(state.step),
        "epoch": epoch,
        "samples": samples,
        "samples_per_s": None,
        **{k: float(v) for k, v in metrics.items() if k != "emitted"},
    }

"""The loop of ``jaxdp train``: state (fresh or resumed), calls in sampler order,
checkpoints at the exact data position, metrics per optimizer step."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from tqdm import tqdm

from .._layout import ProcessShare
from .._position import SamplerPosition
from .._step import TrainStep
from ..checkpoint import CheckpointError, Checkpoints
from ..data import DataChangedError
from ._config import RESUME_FIXED
from ._metrics import MetricsLog, agree

if TYPE_CHECKING:
    from ..data import Batch, Loader
    from ._config import TrainConfig


class NonFiniteStep(RuntimeError):
    """Without skipping, an update with a NaN or Inf loss or gradient was applied: the run
    stops there (``jaxdp train --no-skip-nonfinite``)."""


def say(*args: Any) -> None:
    """``print`` on process 0 only."""
    if jax.process_index() == 0:
        print(*args)


@dataclasses.dataclass
class _Progress:
    """What the loop carries from one update to the next."""

    done: int  # updates applied
    clock: tuple[float, int] | None = None  # (time, samples) after the first update
    accuracy: float | None = None  # held-out, at the last epoch's end


class _Run:
    """The moving parts of one run: state, sampler position, checkpoints."""

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
            fresh, data=self.loader, force=self.config.force_resume, validate=self._validate
        )
        self.state, self.samples = restored.state, self.loader.samples
        self.resumed_step = int(restored.state.step)
        self.position = self.loader.position
        self.last_checkpoint = str(restored.path)
        self.checkpointed = (self.position, self.samples)
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

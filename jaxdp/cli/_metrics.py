"""Training metrics: JSON lines (and TensorBoard events) that survive a resume, the
run's curves as PNG, sums across processes, and lines printed on process 0."""

from __future__ import annotations

import json
import os
import pathlib
import textwrap
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.experimental import multihost_utils

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class MetricsLog:
    """One JSON record per optimizer step, appended to ``path`` (if given), and the
    same numbers as TensorBoard scalars in ``tensorboard`` (a log directory, if given).

    Resuming from optimizer step ``resume_step`` keeps the file's records up to
    that step and drops later ones (written after the checkpoint, before the
    run stopped, a last line cut short by a kill included), so the file reads as
    one uninterrupted run; TensorBoard is
    told the same (events from later steps are purged). ``records`` holds the
    kept and the new records.
    """

    def __init__(
        self, path: str | None, *, resume_step: int | None = None, tensorboard: str | None = None
    ):
        self.records: list[dict[str, Any]] = []
        self._file = None
        self._board = None
        if tensorboard is not None:
            try:  # before the import below: a bad directory costs nothing
                pathlib.Path(tensorboard).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"tensorboard={tensorboard!r} cannot be created: {e}") from None
            # tensorboardX imports torch where it is installed: only when asked for.
            from tensorboardX import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            # A file of its own per process and start (its name has the second and the
            # host): a resume never writes into an earlier start's file.
            self._board = SummaryWriter(
                tensorboard, purge_step=purge, flush_secs=10, filename_suffix=f".{os.getpid()}"
            )
        if path is None:
            return
        file = pathlib.Path(path)
        if resume_step is not None and file.exists():
            text = file.read_text()
            lines = text.splitlines()
            if lines and not text.endswith("\n"):
                lines.pop()  # torn by a kill in the middle of its write: a later step's
            self.records = [r for r in map(json.loads, lines) if r["step"] <= resume_step]
        file.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self._file = file.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._board is not None:
            for name, value in record.items():
                if name not in ("step", "epoch") and value is not None:
                    self._board.add_scalar(
                        BOARD_TAGS.get(name, f"train/{name}"), value, record["step"]
                    )

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._board is not None:
            self._board.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# TensorBoard's names for the records' fields; the others are "train/<field>".
BOARD_TAGS = {"test_accuracy": "held_out/accuracy"}


def smoothed(values: list[float], *, weight: float = 0.9) -> np.ndarray:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    out, mean = np.empty(len(values)), 0.0
    for i, value in enumerate(values):
        mean = weight * mean + (1 - weight) * value
        out[i] = mean / (1 - weight ** (i + 1))
    return out


def plot_training(records: list[dict[str, Any]], path: str, *, title: str) -> Figure:
    """Writes the run as a PNG (matplotlib, no display) and returns the figure.

    Top: the training loss per optimizer step, raw and smoothed (log scale).
    Bottom: the held-out accuracy at each epoch's end, and the learning rate.
    The title is wrapped to the figure's width, never cut.
    """
    # The Figure API renders with Agg and leaves pyplot's global state alone.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 6), dpi=100)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    steps, loss = [r["step"] for r in records], [r["loss"] for r in records]
    top.plot(steps, loss, linewidth=0.8, alpha=0.35, color="C0", label="raw")
    top.plot(steps, smoothed(loss), linewidth=1.5, color="C0", label="smoothed (EMA 0.9)")
    top.set_yscale("log")
    top.set_ylabel("training loss (global batch mean)")
    top.legend(loc="upper right", fontsize=8)
    scored = [r for r in records if r.get("test_accuracy") is not None]
    bottom.plot([r["step"] for r in scored], [r["test_accuracy"] for r in scored], "o-", color="C2")
    bottom.set_ylabel("held-out accuracy", color="C2")
    bottom.set_xlabel("optimizer step")
    rate = [r for r in records if "learning_rate" in r]
    if rate:
        right = bottom.twinx()
        right.plot([r["step"] for r in rate], [r["learning_rate"] for r in rate], color="C1")
        right.set_ylabel("learning rate", color="C1")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    fig.suptitle("\n".join(textwrap.wrap(title, width=70)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return fig


def sum_over_processes(values: np.ndarray) -> np.ndarray:
    """``values`` summed elementwise over all processes (itself with one process).

    A collective: every process must call it, with the same shape and dtype.
    """
    values = np.asarray(values)
    if jax.process_count() == 1:
        return values
    return np.asarray(multihost_utils.process_allgather(values)).sum(axis=0)


def agree(flag: bool) -> bool:
    """True on every process if ``flag`` is True on any (a collective, as above)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(sum_over_processes(np.array([int(bool(flag))]))[0])


def say(*args: Any) -> None:
    """``print`` on process 0 only."""
    if jax.process_index() == 0:
        print(*args)

"""Training metrics: JSON lines that survive a resume, the loss curve as PNG, and
sums across processes."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


class MetricsLog:
    """One JSON record per optimizer step, appended to ``path`` (if given).

    Resuming from optimizer step ``resume_step`` keeps the file's records up to
    that step and drops later ones (written after the checkpoint, before the
    run stopped), so the file reads as one uninterrupted run. ``records`` holds
    the kept and the new records.
    """

    def __init__(self, path: str | None, *, resume_step: int | None = None):
        self.records: list[dict[str, Any]] = []
        self._file = None
        if path is None:
            return
        file = pathlib.Path(path)
        if resume_step is not None and file.exists():
            lines = file.read_text().splitlines()
            self.records = [r for r in map(json.loads, lines) if r["step"] <= resume_step]
        file.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self._file = file.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plot_loss(records: list[dict[str, Any]], path: str, *, title: str) -> None:
    """Writes the training loss per optimizer step as a PNG (matplotlib, no display)."""
    # The Figure API renders with Agg and leaves pyplot's global state alone.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.subplots()
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (global batch mean)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")


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

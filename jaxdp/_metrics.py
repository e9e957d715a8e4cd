"""Training metrics: JSON lines that survive a resume, and the loss curve as PNG."""

from __future__ import annotations

import json
import pathlib
from typing import Any


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

"""A progress bar over the optimizer steps of a loop of one's own (tqdm), on a terminal only."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

import jax

# What the bar shows after each step, when the values hold it.
SHOWN = ("loss", "tokens_per_s", "samples_per_s", "learning_rate")


class Progress:
    """A tqdm bar over optimizer steps: ``progress.update(values)`` after each step advances
    it one step and shows ``keys`` of ``values`` (a :class:`Meter`'s dict) beside it.

    ``enabled=None`` (the default) is tqdm's own choice: a bar when ``file`` (default
    ``sys.stderr``) is a terminal, none when it is a log file, a pipe or CI; ``True`` or
    ``False`` decide. Only process 0 draws it (a multi-process run shows one bar). tqdm is
    an optional dependency (``pip install tqdm``, in jaxdp's ``cli`` extra): without it the
    bar is off under ``enabled=None``, and ``enabled=True`` raises naming the install. A
    disabled bar draws nothing and costs nothing; :meth:`write` prints a line without
    breaking a drawn bar (``print`` otherwise). ``total``: the steps of the run (None:
    unknown), ``initial``: those done before (a resumed run's ``state.step``).
    """

    def __init__(
        self,
        total: int | None = None,
        *,
        initial: int = 0,
        enabled: bool | None = None,
        keys: Sequence[str] = SHOWN,
        file: IO[str] | None = None,
    ):
        for name, value, low in (("total", total, 1), ("initial", initial, 0)):
            if value is not None and not (
                isinstance(value, int) and not isinstance(value, bool) and value >= low
            ):
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")
        if enabled not in (None, True, False):
            raise ValueError(f"enabled={enabled!r} must be None (on a terminal), True or False")
        self.keys = tuple(keys)
        self._file = sys.stderr if file is None else file
        self._bar = None
        if enabled is False or jax.process_index() != 0:
            return
        try:
            from tqdm import tqdm
        except ImportError as e:
            if enabled:
                raise ImportError(
                    "Progress(enabled=True) needs tqdm: pip install tqdm (or jaxdp[cli])"
                ) from e
            return
        # disable=None: tqdm's own test, a bar only when the file is a terminal.
        disable = None if enabled is None else False
        bar = tqdm(total=total, initial=initial, unit="step", file=self._file, disable=disable)
        self._bar = None if bar.disable else bar

    @property
    def disabled(self) -> bool:
        """True when no bar is drawn (not a terminal, not process 0, off, or no tqdm)."""
        return self._bar is None

    def update(self, values: Mapping[str, Any] | None = None) -> None:
        """One optimizer step done; ``values``' ``keys`` shown beside the bar."""
        if self._bar is None:
            return
        if values:
            shown = {k: _short(values[k]) for k in self.keys if k in values}
            self._bar.set_postfix(shown, refresh=False)
        self._bar.update()

    def write(self, text: str) -> None:
        """A line of text above a drawn bar (tqdm.write), else to the file."""
        if self._bar is None:
            print(text, file=self._file)
        else:
            self._bar.write(text, file=self._file)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)

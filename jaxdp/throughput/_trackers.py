"""The usual experiment trackers in one line, as HF Accelerate's ``log_with``."""

from __future__ import annotations

import numbers
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

TRACKERS = ("tensorboard", "wandb")


class Trackers:
    """Writes the numbers of each step to every tracker named in ``log_with``.

    ``log_with``: ``"tensorboard"`` (tensorboardX, no TensorFlow: event files under
    ``logging_dir/project``), ``"wandb"`` (``wandb.init(project=project,
    dir=logging_dir, config=config, **init_kwargs["wandb"])``; W&B offline is
    ``init_kwargs={"wandb": {"mode": "offline"}}``, synced later with ``wandb sync``),
    a list of them, or ``"all"``. Only process 0 writes (the numbers of a data-parallel
    step are the same on every process). ``log(values, step)`` writes a dict of numbers;
    ``close()`` (or ``with``) flushes and ends the runs. A tracker whose package is not
    installed raises ``ImportError`` with its ``pip install`` line, before anything is
    written.
    """

    def __init__(
        self,
        log_with: str | Sequence[str],
        logging_dir: str | pathlib.Path,
        *,
        project: str = "jaxdp",
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ):
        names = list(TRACKERS) if log_with == "all" else _names(log_with)
        unknown = [n for n in names if n not in TRACKERS]
        if unknown or not names:
            raise ValueError(
                f"log_with={log_with!r} must name trackers of {TRACKERS} (or be 'all')"
            )
        init_kwargs = dict(init_kwargs or {})
        extra = set(init_kwargs) - set(names)
        if extra:
            raise ValueError(f"init_kwargs names {sorted(extra)}, not in log_with={names}")
        self.names = names
        self._writers: list[Any] = []
        if jax.process_index() != 0:
            return
        directory = pathlib.Path(logging_dir)
        for name in names:
            module = _imported(name)
            if name == "tensorboard":
                writer = module.SummaryWriter(logdir=str(directory / project))
                if config:
                    writer.add_text("config", repr(dict(config)), 0)
                self._writers.append(_TensorBoard(writer))
            else:
                run = module.init(
                    project=project,
                    dir=str(directory),
                    config=dict(config or {}),
                    **init_kwargs.get("wandb", {}),
                )
                self._writers.append(_WandB(run))

    def log(self, values: Mapping[str, float], step: int) -> None:
        """Writes ``values`` (name -> number) at ``step`` to every tracker. A value that
        is not a real number (a Python or NumPy number, a 0-d array) raises
        ``TypeError`` naming its key, before any tracker writes."""
        for key, value in values.items():
            if not _is_number(value):
                raise TypeError(
                    f"values[{key!r}]={value!r} must be a real number (a Python or NumPy "
                    "number, or a 0-d array): trackers log scalars"
                )
        for writer in self._writers:
            writer.log(values, int(step))

    def close(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers = []

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _is_number(value: Any) -> bool:
    if isinstance(value, numbers.Real):
        return True
    dtype = getattr(value, "dtype", None)
    return (
        getattr(value, "shape", None) == ()
        and dtype is not None
        and any(jnp.issubdtype(dtype, kind) for kind in (jnp.integer, jnp.floating, jnp.bool_))
    )


def _names(log_with: str | Sequence[str]) -> list[str]:
    return [log_with] if isinstance(log_with, str) else list(log_with)


def _imported(name: str) -> Any:
    package = {"tensorboard": "tensorboardX", "wandb": "wandb"}[name]
    try:
        return __import__(package)
    except ImportError as e:
        raise ImportError(f"log_with={name!r} needs {package}: pip install {package}") from e


class _TensorBoard:
    def __init__(self, writer: Any):
        self.writer = writer

    def log(self, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run: Any):
        self.run = run

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()

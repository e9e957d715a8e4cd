"""``jaxdp train --resume``: the run's configuration, from its newest checkpoint.

Every field of :class:`TrainConfig` that the command line did not give comes
from the config the checkpoint was saved with (``extra["config"]``), but those
that say how to resume (:data:`NOT_RESUMED`). A given flag overrides, except
for :data:`RESUME_FIXED` fields, where another value than the checkpoint's is
refused.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from typing import Any

from ..checkpoint import CheckpointError, Checkpoints
from ..checkpoint._meta import check_sealed
from ._config import NOT_RESUMED, RESUME_FIXED, TrainConfig


def resumed_config(given: Mapping[str, Any]) -> tuple[TrainConfig, str]:
    """The config of a resumed run, and one line saying what came from the checkpoint.

    ``given`` holds the fields set on the command line; it must name a
    ``checkpoint_dir``. Raises :class:`CheckpointError` (no readable
    checkpoint, or a given flag the checkpoint cannot continue with).
    """
    meta = Checkpoints(given["checkpoint_dir"], keep=None).metadata()
    saved = meta.extra.get("config", {})
    for name, reason in RESUME_FIXED.items():
        if name in given and name in saved and given[name] != saved[name]:
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(
                f"{flag}={given[name]!r} differs from the checkpoint's {name}={saved[name]!r} "
                f"({meta.path}); a resumed run keeps it ({reason}): leave {flag} out, or start "
                "a new run in another --checkpoint-dir"
            )
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    taken = {
        name: saved[name]
        for name in fields
        if name in saved and name not in given and name not in NOT_RESUMED
    }
    config = TrainConfig(**{**taken, **given})
    fresh = TrainConfig()
    shown = ", ".join(f"{k}={v!r}" for k, v in taken.items() if v != getattr(fresh, k))
    line = f"taken from checkpoint {meta.path} for the options not given: " + (
        f"{shown} (the others: the defaults)" if shown else "the defaults"
    )
    return config, line


def has_checkpoints(checkpoint_dir: str) -> bool:
    """Whether ``checkpoint_dir`` holds a complete checkpoint (readable or not): without
    one, ``--resume`` starts a fresh run; with only unreadable ones, it is refused."""
    if not pathlib.Path(checkpoint_dir).is_dir():
        return False
    return bool(Checkpoints(checkpoint_dir, keep=None).steps)


def saved_cpu_devices(checkpoint_dir: str) -> int | None:
    """The newest checkpoint's ``cpu_devices``, read before JAX starts (its device count
    must be set then), from the files alone: no checkpoint manager opens the directory
    (which clears unfinished saves) outside the directory's lock. None if there is no
    checkpoint whose meta reads; the resume itself reads them properly afterwards."""
    folder = pathlib.Path(checkpoint_dir)
    numbers = [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []
    for number in sorted(numbers, reverse=True):
        try:
            meta = check_sealed(
                json.loads((folder / str(number) / "meta" / "metadata").read_text())
            )
        except (OSError, ValueError):  # CheckpointError and JSON errors included
            continue
        value = meta.get("extra", {}).get("config", {}).get("cpu_devices")
        return value if isinstance(value, int) else None
    return None


def check_continues(config: TrainConfig, extra: Mapping[str, Any]) -> None:
    """Raises CheckpointError where the checkpoint's config (``extra["config"]``, as
    :meth:`Checkpoints.save` stored it) and ``config`` differ in a field a resume cannot
    change (:data:`RESUME_FIXED`, each with its reason)."""
    saved = extra.get("config", {})
    for name, reason in RESUME_FIXED.items():
        if saved.get(name) != getattr(config, name):
            raise CheckpointError(
                f"the checkpoint was trained with {name}={saved.get(name)!r}; this run has "
                f"{name}={getattr(config, name)!r} ({reason})"
            )

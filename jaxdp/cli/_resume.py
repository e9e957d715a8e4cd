"""``jaxdp train --resume``: the run's configuration, from its newest checkpoint.

Every field of :class:`TrainConfig` that the command line did not give comes
from the config the checkpoint was saved with (``extra["config"]``), but those
that say how to resume (:data:`NOT_RESUMED`). A given flag overrides, except
for :data:`RESUME_FIXED` fields, where another value than the checkpoint's is
refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..checkpoint._checkpoints import Checkpoints
from ..checkpoint._rules import CheckpointError
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

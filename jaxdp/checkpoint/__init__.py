"""Checkpoints of a jaxdp training run (orbax): atomic, verified, resumable exactly.

``Checkpoints(directory).save(state, position=..., sizes=..., samples=...)``
writes one checkpoint per optimizer step; ``restore(like, sizes=...)`` reads
the newest readable one into a state laid out like ``like`` (a fresh
``TrainStep.init``), on this run's mesh, with the data position to continue
from (:func:`jaxdp.resume_position`). Everything not re-exported here is private.
"""

from ._checkpoints import Checkpoints as Checkpoints
from ._checkpoints import CorruptCheckpointWarning as CorruptCheckpointWarning
from ._checkpoints import Restored as Restored
from ._rules import CheckpointError as CheckpointError

__all__ = ["CheckpointError", "Checkpoints", "CorruptCheckpointWarning", "Restored"]

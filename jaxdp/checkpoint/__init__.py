"""Checkpoints of a jaxdp training run (orbax): atomic, verified, resumable exactly.

``Checkpoints(directory).save(state, position=..., sizes=..., samples=...)`` (or
``data=`` a :class:`jaxdp.data.Loader`, or ``save(state, data={...})`` with a data
pipeline of one's own, its JSON record handed back as ``Restored.data``) writes a
checkpoint named by the state's optimizer step (``directory/<step>``, never
overwritten); ``restore(like, sizes=...)`` reads the newest readable one
into a state laid out like ``like`` (a fresh ``TrainStep.init``), on this run's
mesh, with the data position to continue from (:func:`jaxdp.resume_position`);
``metadata()`` reads what the newest says about itself (step, position, batch,
samples, ``extra``) without its arrays. Everything not re-exported here is private.
"""

from ._checkpoints import Checkpoints as Checkpoints
from ._checkpoints import CorruptCheckpointWarning as CorruptCheckpointWarning
from ._checkpoints import Metadata as Metadata
from ._checkpoints import Restored as Restored
from ._rules import CheckpointError as CheckpointError

__all__ = ["CheckpointError", "Checkpoints", "CorruptCheckpointWarning", "Metadata", "Restored"]

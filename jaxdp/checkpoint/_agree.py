"""Process 0's view of the checkpoint directory, given to every process.

Each process lists the directory itself, and a listing can lag another
process's delete or rename on a shared file system. orbax's ``delete`` is a
collective (a barrier named per call): one process deleting a checkpoint the
others no longer list ended the run in a barrier name mismatch (seen in 1 of 4
two-process runs of ``jaxdp train --checkpoint-every 2`` with ``--keep 3``).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def process_0s(numbers: list[int]) -> list[int]:
    """``numbers`` as process 0 has them, on every process (two small broadcasts)."""
    if jax.process_count() == 1:
        return numbers
    count = int(multihost_utils.broadcast_one_to_all(np.int64(len(numbers))))
    if count == 0:
        return []
    padded = np.zeros(count, np.int64)
    padded[: min(count, len(numbers))] = numbers[:count]
    return [int(n) for n in multihost_utils.broadcast_one_to_all(padded)]

"""A data-parallel input pipeline: each process reads its rows of every call, ahead.

``Loader(source, sizes, mesh=step.mesh, path=step.path)`` yields the calls of
a :class:`jaxdp.TrainStep` in :func:`jaxdp.epoch_schedule`'s order (torch's
DistributedSampler, one rank per device), read by worker threads (grain) and
placed on the mesh before the step asks (or from a stream, each process its own shard:
a grain ``IterDataset``, a Hugging Face streaming dataset); its position is saved and restored by
``jaxdp.checkpoint.Checkpoints`` with ``data=loader``. ``evaluate`` scores a
held-out set over the mesh (per-row metrics, summed over devices and
processes). Needs the ``data``
extra (``pip install jaxdp[data]``). Everything not re-exported here is private.
"""

from ._evaluate import MetricsFn as MetricsFn
from ._evaluate import evaluate as evaluate
from ._fingerprint import DataChangedError as DataChangedError
from ._loader import Batch as Batch
from ._loader import Loader as Loader
from ._prefetch import LoaderTimeoutError as LoaderTimeoutError
from ._prefetch import LoaderWorkerError as LoaderWorkerError
from ._source import Transform as Transform

__all__ = [
    "Batch",
    "DataChangedError",
    "Loader",
    "LoaderTimeoutError",
    "LoaderWorkerError",
    "MetricsFn",
    "Transform",
    "evaluate",
]

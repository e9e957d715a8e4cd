"""jaxdp: data-parallel training with gradient accumulation for JAX.

The batch is split over a one-axis device mesh; every optimizer step averages
gradients once, on the last micro-batch only, exactly like PyTorch DDP with
``no_sync()``: on GPUs in buckets that run under the rest of its backward, on CPU in
one all-reduce. This module is the core a training script
needs; the tools are subpackages, imported on first use:
``jaxdp.checkpoint``, ``jaxdp.data``, ``jaxdp.models``, ``jaxdp.parity``, ``jaxdp.plan``,
``jaxdp.testing`` and ``jaxdp.cli``. Everything not re-exported is private.

``import jaxdp`` imports no JAX, flax or optax: each name is imported from
its module on first use, so a process that only launches others, or prints
the command line's help, never pays for them. Nor does any of it start JAX's
backend, so :func:`emulate_cpu_devices` still works right after it.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

if _TYPE_CHECKING:  # for type checkers; at run time __getattr__ imports each on first use
    from ._distributed import initialize as initialize
    from ._forward import LossReduction as LossReduction
    from ._frozen import Trainable as Trainable
    from ._layers import scan_layers as scan_layers
    from ._layout import BatchSizes as BatchSizes
    from ._layout import EpochSchedule as EpochSchedule
    from ._layout import LastWindow as LastWindow
    from ._layout import ProcessShare as ProcessShare
    from ._layout import batch_sizes as batch_sizes
    from ._layout import epoch_schedule as epoch_schedule
    from ._layout import micro_batches as micro_batches
    from ._layout import process_share as process_share
    from ._mesh import DATA_AXIS as DATA_AXIS
    from ._mesh import data_mesh as data_mesh
    from ._mesh import emulate_cpu_devices as emulate_cpu_devices
    from ._model_state import BatchStats as BatchStats
    from ._options import AccumulationPath as AccumulationPath
    from ._options import Parallel as Parallel
    from ._options import Skips as Skips
    from ._options import Strategy as Strategy
    from ._position import SamplerPosition as SamplerPosition
    from ._position import resume_position as resume_position
    from ._replicas import ReplicaMismatchError as ReplicaMismatchError
    from ._replicas import check_replicas as check_replicas
    from ._sampler import DistributedSampler as DistributedSampler
    from ._skip_watch import SkipWatch as SkipWatch
    from ._step import TrainStep as TrainStep
    from ._step import make_train_step as make_train_step
    from ._train_state import NonFiniteError as NonFiniteError
    from ._train_state import TrainState as TrainState
    from ._train_state import Window as Window

__version__ = "0.3.0"

__all__ = [
    # Mesh and devices
    "DATA_AXIS",
    "data_mesh",
    "emulate_cpu_devices",
    # Several processes
    "initialize",
    "process_share",
    "ProcessShare",
    # Batch identity, data order and position
    "BatchSizes",
    "batch_sizes",
    "DistributedSampler",
    "EpochSchedule",
    "epoch_schedule",
    "LastWindow",
    "micro_batches",
    "SamplerPosition",
    "resume_position",
    # The train step, its state and its errors
    "make_train_step",
    "TrainStep",
    "TrainState",
    "Window",
    "SkipWatch",
    "NonFiniteError",
    "Parallel",
    "scan_layers",
    "Skips",
    "ReplicaMismatchError",
    "check_replicas",
    "AccumulationPath",
    "Strategy",
    "LossReduction",
    "BatchStats",
    "Trainable",
]

# Where each name of the core is defined (as the imports above say to type checkers),
# imported on first use by __getattr__.
_HOMES = {
    "initialize": "_distributed",
    "LossReduction": "_forward",
    "Trainable": "_frozen",
    "scan_layers": "_layers",
    "BatchSizes": "_layout",
    "EpochSchedule": "_layout",
    "LastWindow": "_layout",
    "ProcessShare": "_layout",
    "batch_sizes": "_layout",
    "epoch_schedule": "_layout",
    "micro_batches": "_layout",
    "process_share": "_layout",
    "DATA_AXIS": "_mesh",
    "data_mesh": "_mesh",
    "emulate_cpu_devices": "_mesh",
    "BatchStats": "_model_state",
    "AccumulationPath": "_options",
    "Parallel": "_options",
    "Skips": "_options",
    "Strategy": "_options",
    "SamplerPosition": "_position",
    "resume_position": "_position",
    "ReplicaMismatchError": "_replicas",
    "check_replicas": "_replicas",
    "DistributedSampler": "_sampler",
    "SkipWatch": "_skip_watch",
    "TrainStep": "_step",
    "make_train_step": "_step",
    "NonFiniteError": "_train_state",
    "TrainState": "_train_state",
    "Window": "_train_state",
}
# The tools, imported on first use (``jaxdp.checkpoint.Checkpoints`` after ``import jaxdp``).
_SUBPACKAGES = frozenset(
    {"checkpoint", "cli", "data", "models", "parity", "plan", "testing", "throughput"}
)
# Names that moved to a tool in jaxdp 0.3, still found here until 0.4 (with a
# DeprecationWarning): the inspection of compiled programs is a testing tool.
_MOVED = {
    name: "testing"
    for name in ("all_reduces", "AllReduce", "collectives", "Collective", "format_report")
}


def __getattr__(name: str) -> _Any:
    if name in _HOMES:
        value = getattr(_importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
        globals()[name] = value  # found directly from now on
        return value
    if name in _SUBPACKAGES:
        return _importlib.import_module(f"{__name__}.{name}")
    import warnings

    if name == "AccumState":  # jaxdp 0.2's name of the open window's record
        warnings.warn(
            "jaxdp.AccumState is deprecated: the open window is jaxdp.Window since jaxdp 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return __getattr__("Window")
    if name in ("torch_to_params", "params_to_torch"):  # jaxdp 0.2's names
        return _moved_to_parity(name)
    if name in _MOVED:
        tool = _MOVED[name]
        warnings.warn(
            f"jaxdp.{name} is deprecated: use jaxdp.{tool}.{name} (moved in jaxdp 0.3; the "
            "old name goes in 0.4)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_importlib.import_module(f"{__name__}.{tool}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _moved_to_parity(name: str) -> _Any:
    import functools
    import warnings

    warnings.warn(
        f"jaxdp.{name} is deprecated: use jaxdp.parity.{name} (moved in jaxdp 0.3; it "
        "reads each weight's layout from the torch module, torch_to_params(model, like); the "
        "old name goes in 0.4)",
        DeprecationWarning,
        stacklevel=3,
    )
    moved = getattr(_importlib.import_module(f"{__name__}.parity"), name)
    # jaxdp 0.2 read every kernel as nn.Linear's or nn.Conv's [out, in, *k].
    return functools.partial(moved, layouts="out_in")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBPACKAGES})

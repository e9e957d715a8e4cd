"""jaxdp: data-parallel training with gradient accumulation for JAX.

The batch is split over a one-axis device mesh; every optimizer step averages
gradients with ONE all-reduce issued after the last micro-batch, exactly like
PyTorch DDP with ``no_sync()``. Everything not re-exported here is private.
"""

from ._accumulate import AccumState as AccumState
from ._checkpoint import Checkpoints as Checkpoints
from ._checkpoint import CorruptCheckpointWarning as CorruptCheckpointWarning
from ._checkpoint import Restored as Restored
from ._distributed import initialize as initialize
from ._inspect import AllReduce as AllReduce
from ._inspect import all_reduces as all_reduces
from ._inspect import format_report as format_report
from ._interop import params_to_torch as params_to_torch
from ._interop import torch_to_params as torch_to_params
from ._layout import BatchSizes as BatchSizes
from ._layout import EpochSchedule as EpochSchedule
from ._layout import ProcessShare as ProcessShare
from ._layout import batch_sizes as batch_sizes
from ._layout import epoch_batches as epoch_batches
from ._layout import epoch_schedule as epoch_schedule
from ._layout import micro_batches as micro_batches
from ._layout import process_share as process_share
from ._mesh import DATA_AXIS as DATA_AXIS
from ._mesh import data_mesh as data_mesh
from ._mesh import emulate_cpu_devices as emulate_cpu_devices
from ._models import CNN as CNN
from ._models import CNNBN as CNNBN
from ._models import MLP as MLP
from ._models import MODELS as MODELS
from ._models import BatchNorm as BatchNorm
from ._models import EmbedBranch as EmbedBranch
from ._models import LinearModel as LinearModel
from ._models import Transformer as Transformer
from ._models import build_model as build_model
from ._models import model_loss as model_loss
from ._parity import OptimizerSpec as OptimizerSpec
from ._parity import ParityConfig as ParityConfig
from ._parity import ParityReport as ParityReport
from ._parity import clip_grad_norm_like_torch as clip_grad_norm_like_torch
from ._parity import format_parity as format_parity
from ._parity import optax_like_torch as optax_like_torch
from ._parity import run_parity as run_parity
from ._plan import DTYPE_POLICIES as DTYPE_POLICIES
from ._plan import OPTIMIZER_MOMENTS as OPTIMIZER_MOMENTS
from ._plan import MemoryPlan as MemoryPlan
from ._plan import parse_bytes as parse_bytes
from ._plan import plan_memory as plan_memory
from ._plan import ring_all_reduce_bytes as ring_all_reduce_bytes
from ._plan_xla import CompiledMemory as CompiledMemory
from ._plan_xla import compiled_memory as compiled_memory
from ._resume import CheckpointError as CheckpointError
from ._resume import SamplerPosition as SamplerPosition
from ._resume import resume_position as resume_position
from ._sampler import DistributedSampler as DistributedSampler
from ._sampler import numpy_permutation as numpy_permutation
from ._step import TrainStep as TrainStep
from ._step import make_train_step as make_train_step
from ._sync import ReplicaMismatchError as ReplicaMismatchError
from ._sync import SyncState as SyncState
from ._sync import all_reduce_mean as all_reduce_mean
from ._sync import check_replicas as check_replicas
from ._sync import sync_on_emit as sync_on_emit
from ._train_state import NonFiniteError as NonFiniteError
from ._train_state import TrainState as TrainState

__version__ = "0.1.0"

__all__ = [
    "CNN",
    "CNNBN",
    "DATA_AXIS",
    "DTYPE_POLICIES",
    "MLP",
    "MODELS",
    "OPTIMIZER_MOMENTS",
    "AccumState",
    "AllReduce",
    "BatchNorm",
    "BatchSizes",
    "CheckpointError",
    "Checkpoints",
    "CompiledMemory",
    "CorruptCheckpointWarning",
    "DistributedSampler",
    "EmbedBranch",
    "EpochSchedule",
    "LinearModel",
    "MemoryPlan",
    "NonFiniteError",
    "OptimizerSpec",
    "ParityConfig",
    "ParityReport",
    "ProcessShare",
    "ReplicaMismatchError",
    "Restored",
    "SamplerPosition",
    "SyncState",
    "TrainState",
    "TrainStep",
    "Transformer",
    "all_reduce_mean",
    "all_reduces",
    "batch_sizes",
    "build_model",
    "check_replicas",
    "clip_grad_norm_like_torch",
    "compiled_memory",
    "data_mesh",
    "emulate_cpu_devices",
    "epoch_batches",
    "epoch_schedule",
    "format_parity",
    "format_report",
    "initialize",
    "make_train_step",
    "micro_batches",
    "model_loss",
    "numpy_permutation",
    "optax_like_torch",
    "params_to_torch",
    "parse_bytes",
    "plan_memory",
    "process_share",
    "resume_position",
    "ring_all_reduce_bytes",
    "run_parity",
    "sync_on_emit",
    "torch_to_params",
]

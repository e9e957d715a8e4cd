"""torch_ref: the PyTorch reference for jaxdp, plain DDP + gradient accumulation.

Plain PyTorch as its documentation teaches it (DistributedSampler, DDP,
``no_sync``, ``loss / accum_steps``; ZeroRedundancyOptimizer, FSDP2's
``fully_shard`` and HSDP as options of ``TrainConfig``); it never imports jaxdp
or jax. Besides its
reference models it trains a user's own (``TrainConfig(model=..., loss=...)``,
see ``torch_ref.user``), and a team's own script records itself for jaxdp's
comparison with a ``Recorder`` (``torch_ref.record``).
"""

from ._launch import launch as launch
from ._launch import load_results as load_results
from ._launch import save_jobs as save_jobs
from .comm_hooks import COMM_HOOKS as COMM_HOOKS
from .models import CNN as CNN
from .models import MLP as MLP
from .models import MODELS as MODELS
from .models import LinearModel as LinearModel
from .models import Transformer as Transformer
from .models import build_model as build_model
from .models import compute_loss as compute_loss
from .models import make_data as make_data
from .models import numpy_state_dict as numpy_state_dict
from .models import seed_data as seed_data
from .optim import OptimConfig as OptimConfig
from .optim import ParamGroup as ParamGroup
from .optim import build_optimizer as build_optimizer
from .optim import optimizer_state_bytes as optimizer_state_bytes
from .record import RECORD_ENV as RECORD_ENV
from .record import Record as Record
from .record import Recorder as Recorder
from .record import load_record as load_record
from .record import record_script as record_script
from .train import Result as Result
from .train import TrainConfig as TrainConfig
from .train import check_job as check_job
from .train import micro_batches_per_epoch as micro_batches_per_epoch
from .train import steps_per_epoch as steps_per_epoch
from .train import torch_permutation as torch_permutation
from .train import train_ddp as train_ddp
from .train import train_ddp_many as train_ddp_many
from .train import train_ga as train_ga
from .train import train_window as train_window
from .user import LOSSES as LOSSES
from .user import load_attr as load_attr

__all__ = [
    "CNN",
    "COMM_HOOKS",
    "LOSSES",
    "MLP",
    "MODELS",
    "LinearModel",
    "OptimConfig",
    "ParamGroup",
    "RECORD_ENV",
    "Record",
    "Recorder",
    "Result",
    "TrainConfig",
    "Transformer",
    "build_model",
    "build_optimizer",
    "check_job",
    "compute_loss",
    "launch",
    "load_attr",
    "load_record",
    "load_results",
    "make_data",
    "micro_batches_per_epoch",
    "numpy_state_dict",
    "record_script",
    "optimizer_state_bytes",
    "save_jobs",
    "seed_data",
    "steps_per_epoch",
    "torch_permutation",
    "train_ddp",
    "train_ddp_many",
    "train_ga",
    "train_window",
]

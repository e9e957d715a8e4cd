"""Reference models in Flax NNX, the twins of ``torch_ref.models`` (same attribute
names, so weights convert with :func:`jaxdp.parity.torch_to_params`).

They are what the parity tests, ``jaxdp train``, ``jaxdp plan`` and the
benchmarks train; a model of your own needs none of this. Everything not
re-exported here is private.
"""

from ._reference import CNN as CNN
from ._reference import CNNBN as CNNBN
from ._reference import LAYER_NORM_EPS as LAYER_NORM_EPS
from ._reference import MLP as MLP
from ._reference import MODEL_AXIS as MODEL_AXIS
from ._reference import MODELS as MODELS
from ._reference import TENSOR_PARALLEL as TENSOR_PARALLEL
from ._reference import TRAINABLE as TRAINABLE
from ._reference import BatchNorm as BatchNorm
from ._reference import EmbedBranch as EmbedBranch
from ._reference import LinearModel as LinearModel
from ._reference import Stack as Stack
from ._reference import Transformer as Transformer
from ._reference import build_model as build_model
from ._reference import check_tp as check_tp
from ._reference import model_loss as model_loss
from ._reference import with_megatron_plan as with_megatron_plan
from ._scanned import ScannedTransformer as ScannedTransformer
from ._scanned import stack_blocks as stack_blocks

__all__ = [
    "CNN",
    "CNNBN",
    "LAYER_NORM_EPS",
    "MLP",
    "MODEL_AXIS",
    "MODELS",
    "TENSOR_PARALLEL",
    "TRAINABLE",
    "BatchNorm",
    "EmbedBranch",
    "LinearModel",
    "ScannedTransformer",
    "Stack",
    "Transformer",
    "build_model",
    "check_tp",
    "model_loss",
    "stack_blocks",
    "with_megatron_plan",
]

"""Parity with PyTorch: jaxdp and torch_ref (real PyTorch DDP + gradient accumulation)
trained from the same weights on the same data in the same order, compared after
every optimizer step.

``run_parity(ParityConfig(...))`` trains both sides on a reference model and
returns a :class:`ParityReport`; ``compare_models(torch_model, jax_model, data)``
does the same for a user's own torch model and its JAX port (Flax NNX, Flax Linen or
equinox), and locates where
they first diverge (``assert_trains_like`` for test suites); ``compare_recorded(record,
torch_model, jax_model)`` the same against a team's own torch script, as its
``torch_ref.Recorder`` recorded it;
``optax_like_torch(OptimizerSpec(...))`` is the optax chain that updates exactly
as ``torch.optim`` does (its parameter groups, ``ParamGroup``, through
``optax.multi_transform``); ``torch_to_params(torch_model, jax_params)`` and
``params_to_torch(jax_params, torch_model)`` carry weights each way, every layer in
its own layout (a Hugging Face GPT-2's Conv1D too). torch and torch_ref are
imported only when a run starts. Everything not re-exported here is private.
"""

from ._compare_models import assert_trains_like as assert_trains_like
from ._compare_models import compare_models as compare_models
from ._convert import params_to_torch as params_to_torch
from ._convert import torch_to_params as torch_to_params
from ._locate_text import Divergence as Divergence
from ._optim import OPTIMIZERS as OPTIMIZERS
from ._optim import OptimizerSpec as OptimizerSpec
from ._optim import ParamGroup as ParamGroup
from ._optim import clip_grad_norm_like_torch as clip_grad_norm_like_torch
from ._optim import onecycle_like_torch as onecycle_like_torch
from ._optim import optax_like_torch as optax_like_torch
from ._recorded import compare_recorded as compare_recorded
from ._report import format_parity as format_parity
from ._report import plot_parity as plot_parity
from ._runner import ATOL as ATOL
from ._runner import RTOL as RTOL
from ._runner import ParityConfig as ParityConfig
from ._runner import ParityReport as ParityReport
from ._runner import Trajectory as Trajectory
from ._runner import compare as compare
from ._runner import run_jaxdp as run_jaxdp
from ._runner import run_parity as run_parity
from ._runner import run_torch as run_torch
from ._runner import torch_config as torch_config
from ._runner import torch_inputs as torch_inputs

__all__ = [
    "ATOL",
    "Divergence",
    "OPTIMIZERS",
    "RTOL",
    "OptimizerSpec",
    "ParamGroup",
    "ParityConfig",
    "ParityReport",
    "Trajectory",
    "assert_trains_like",
    "clip_grad_norm_like_torch",
    "compare",
    "compare_models",
    "compare_recorded",
    "format_parity",
    "onecycle_like_torch",
    "optax_like_torch",
    "params_to_torch",
    "plot_parity",
    "run_jaxdp",
    "run_parity",
    "run_torch",
    "torch_config",
    "torch_inputs",
    "torch_to_params",
]

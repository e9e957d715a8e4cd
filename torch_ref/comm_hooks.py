"""DDP communication hooks by name (``TrainConfig.comm_hook``), as torch_ref registers them.

``"bf16"`` is torch's ``default_hooks.bf16_compress_hook``: on the synced
backward each gradient bucket is cast to bfloat16, divided by the world size
(in bfloat16), all-reduced with SUM in bfloat16, and copied back into the
bucket's dtype. On CUDA torch_ref registers that function itself. On CPU,
``DistributedDataParallel.register_comm_hook`` refuses it BY NAME (torch 2.13,
``_check_comm_hook``: "BF16 all reduce communication hook required CUDA 11+ and
NCCL 2.10+ or XPU and XCCL") although gloo all-reduces bfloat16 tensors on CPU
(checked), so torch_ref registers ``cpu_bf16_compress_hook``, which calls the
same function: the same casts, division and bfloat16 all-reduce, under a name
the check lets through.

No ``from __future__ import annotations`` here: DDP reads a hook's annotations
and refuses ones that are strings.
"""

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

COMM_HOOKS = ("bf16",)
"""The hooks ``TrainConfig.comm_hook`` names."""


def cpu_bf16_compress_hook(process_group, bucket):
    """``default_hooks.bf16_compress_hook(process_group, bucket)``, under a name DDP
    registers on a CPU build of torch (module docstring)."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def register_comm_hook(model: DistributedDataParallel, name: str, device: str) -> None:
    """Registers the hook ``name`` (one of ``COMM_HOOKS``) on ``model`` for the world group."""
    if name not in COMM_HOOKS:
        raise ValueError(f"comm_hook={name!r} must be one of {COMM_HOOKS}")
    hook = default_hooks.bf16_compress_hook if device == "cuda" else cpu_bf16_compress_hook
    model.register_comm_hook(dist.group.WORLD, hook)

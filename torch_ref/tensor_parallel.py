"""Tensor parallelism x data parallelism, as PyTorch teaches it: the model's Megatron plan
applied with ``parallelize_module`` on the ``"tp"`` dimension of a ``("dp", "tp")``
``DeviceMesh`` (``tp`` ranks innermost: rank ``r`` is data rank ``r // tp``), then DDP
(``DDP(module, device_mesh=mesh["dp"])``) or FSDP2 (``fully_shard`` per block, then the
root, on ``mesh["dp"]``) over the data dimension. The ``tp`` ranks of a data rank read
the same micro-batches (its ``DistributedSampler`` shard).

Two things the composition needs that plain DDP and FSDP2 do not, both here:
- DDP with a ``device_mesh`` turns each DTensor parameter into a plain Parameter of its
  local shard (``torch.distributed.tensor.parallel.ddp``), rebuilt as a DTensor attribute
  at every forward: after the first step ``module.parameters()`` no longer lists the
  split leaves. The optimizer, the clip and the recorded state take the parameters as
  they are right after the wrap, and each split one is read whole from its shards with
  the placement it had before.
- torch's ``clip_grad_norm_`` stacks the per-tensor norms, which it cannot for DTensors
  on different meshes (FSDP2's split leaves live on ``(dp, tp)``, the others on ``dp``)
  nor for DDP's local shards (each rank's norm would be of its shard). :meth:`clip_`
  takes the same steps on each tensor's whole norm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

State = dict[str, np.ndarray]


def _stack_plan(module: torch.nn.Module) -> dict[str, Any]:
    """``stack``'s Megatron plan: each block's ``fc`` split by its output features
    (``ColwiseParallel``) and its ``proj`` by its input features (``RowwiseParallel``:
    one all-reduce over ``tp`` per block); the rest replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(len(module.blocks)):
        plan[f"blocks.{i}.fc"] = ColwiseParallel()
        plan[f"blocks.{i}.proj"] = RowwiseParallel()
    return plan


MEGATRON_PLANS = {"stack": _stack_plan}
"""The reference models with a tensor-parallel plan: name -> ``plan(module)``."""


@dataclass
class TensorParallel:
    """A module under TP x DDP or TP x FSDP2. ``model``: what the loop calls (DDP's
    wrapper, or the module FSDP2 sharded in place); ``named``: the parameters as the
    optimizer takes them; ``placed``: each split leaf's ``(mesh, placements, shape,
    stride)`` before DDP made it local (empty under FSDP2, whose leaves stay DTensors)."""

    model: torch.nn.Module
    named: list[tuple[str, torch.Tensor]]
    placed: dict[str, tuple[Any, Any, torch.Size, tuple[int, ...]]]

    def _whole(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (a parameter or its gradient) as a DTensor where it is split, else
        itself."""
        from torch.distributed.tensor import DTensor

        if name in self.placed:
            mesh, placements, shape, stride = self.placed[name]
            return DTensor.from_local(
                tensor, mesh, placements, run_check=False, shape=shape, stride=stride
            )
        return tensor

    def state(self) -> State:
        """Every parameter whole, by name (``full_tensor()``: a collective every rank
        joins)."""
        out = {}
        for name, p in self.named:
            whole = self._whole(name, p.detach())
            whole = whole.full_tensor() if hasattr(whole, "full_tensor") else whole
            out[name] = whole.cpu().numpy().copy()
        return out

    def clip_(self, max_norm: float) -> torch.Tensor:
        """``clip_grad_norm_(parameters, max_norm)``'s steps on the whole gradients: the
        norm of every tensor's norm, the coefficient ``max_norm / (norm + 1e-6)`` capped
        at 1, each gradient multiplied by it in place. Returns the norm."""
        grads = [(name, p.grad) for name, p in self.named if p.grad is not None]
        norms = []
        for name, g in grads:
            norm = torch.linalg.vector_norm(self._whole(name, g))
            norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        total = torch.linalg.vector_norm(torch.stack(norms))
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for _, g in grads:
            g.mul_(coefficient.item())  # a double: the same product as by the 0-d tensor
        return total


def tensor_parallel(
    module: torch.nn.Module, config: Any, shard: Callable[..., torch.nn.Module] | None
) -> TensorParallel:
    """``module`` (on its device, with its initial weights) split by its Megatron plan
    over ``config.tp`` ranks and wrapped for data parallelism over the rest: DDP, or
    ``shard(module, mesh)`` (torch_ref.train's FSDP2 on the data ranks' mesh; with
    ``config.shards`` below the data ranks HSDP, on the ``("replicate", "shard")``
    submesh of a ``("replicate", "shard", "tp")`` mesh, torchtitan's layout)."""
    # Imported here: the DDP runs never need them, and DTensor takes seconds to import.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    ranks = config.num_devices // config.tp
    if config.shards is not None and config.shards < ranks:  # HSDP over the data ranks
        shape, names = (ranks // config.shards, config.shards, config.tp), ("replicate", "shard")
    else:
        shape, names = (ranks, config.tp), ("dp",)
    mesh = init_device_mesh(config.device, shape, mesh_dim_names=(*names, "tp"))
    data = mesh[names] if len(names) > 1 else mesh[names[0]]
    parallelize_module(module, mesh["tp"], MEGATRON_PLANS[config.model](module))
    placed = {
        name: (p.device_mesh, p.placements, p.shape, p.stride())
        for name, p in module.named_parameters()
        if isinstance(p, DTensor)
    }
    if shard is not None:  # FSDP2's leaves stay DTensors
        model, placed = shard(module, data), {}
    else:
        model = DDP(module, device_mesh=data)
    return TensorParallel(model, list(module.named_parameters()), placed)

"""Optimizer settings shared with the jaxdp side, and the torch optimizer they build."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class OptimConfig:
    """One optimizer, in torch's terms (optax's equivalents in parentheses).

    sgd: ``torch.optim.SGD`` without dampening; ``weight_decay`` is added to the
    gradient before momentum (``optax.chain(add_decayed_weights, sgd)``).
    adamw: ``torch.optim.AdamW`` with decoupled ``weight_decay`` (``optax.adamw``
    with ``eps_root=0``); note torch's own default decay is 1e-2, here 0.
    ``max_grad_norm``: clip the averaged gradients to this global L2 norm
    (``clip_grad_norm_`` after DDP's sync: scale by ``min(1, max / (norm + 1e-6))``;
    ``optax.clip_by_global_norm`` has no ``1e-6``, so it is not an exact twin).
    """

    name: Literal["sgd", "adamw"]
    learning_rate: float
    momentum: float = 0.0  # sgd only
    nesterov: bool = False  # sgd only; needs momentum > 0
    weight_decay: float = 0.0
    b1: float = 0.9  # adamw only
    b2: float = 0.999  # adamw only
    eps: float = 1e-8  # adamw only
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer name={self.name!r} is unknown; choose one of {OPTIMIZERS}")
        if not self.learning_rate >= 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be >= 0")
        if not self.momentum >= 0:
            raise ValueError(f"momentum={self.momentum} must be >= 0")
        if self.nesterov and (self.name != "sgd" or self.momentum == 0):
            raise ValueError(
                f"nesterov=True needs name='sgd' and momentum > 0, got name={self.name!r}, "
                f"momentum={self.momentum}"
            )
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"b1={self.b1} and b2={self.b2} must be in [0, 1)")
        if not self.eps >= 0:
            raise ValueError(f"eps={self.eps} must be >= 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be > 0 (or None)")


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimConfig, *, zero: bool = False
) -> torch.optim.Optimizer:
    """``torch.optim.SGD`` (dampening 0) or ``torch.optim.AdamW`` with ``cfg``'s settings.

    ``zero=True``: the same optimizer inside
    ``torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class=...)``
    (needs a process group). Each rank owns whole parameters (largest first, each
    to the rank holding the fewest elements so far), keeps only their state, steps
    only them, and broadcasts them to the other ranks after its step.
    """
    optimizer_class, settings = _torch_optimizer(cfg)
    if zero:
        # Imported here: torch.distributed.optim takes seconds to import (it scripts its
        # functional optimizers with torch.jit, warning each time) and most runs skip it.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **settings)
    return optimizer_class(params, **settings)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state ``optimizer`` holds (momentum buffers, Adam's moments and
    step counts). For a ``ZeroRedundancyOptimizer`` pass its local optimizer,
    ``.optim``: the state of the parameters this rank owns. Under FSDP2 the state of
    a sharded parameter is sharded too: its bytes are this rank's shard's."""
    return sum(
        local_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor`` this rank holds: a DTensor's (FSDP2's) local shard, unpadded;
    a plain tensor's all."""
    # DTensor's public method, read without importing DTensor (seconds) in DDP runs.
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _torch_optimizer(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    if cfg.name == "sgd":
        return torch.optim.SGD, dict(
            lr=cfg.learning_rate,
            momentum=cfg.momentum,
            dampening=0.0,
            weight_decay=cfg.weight_decay,
            nesterov=cfg.nesterov,
        )
    return torch.optim.AdamW, dict(
        lr=cfg.learning_rate, betas=(cfg.b1, cfg.b2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )

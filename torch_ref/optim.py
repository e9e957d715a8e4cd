"""Optimizer settings shared with the jaxdp side, and the torch optimizer they build."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class ParamGroup:
    """A parameter group after the first (``optimizer.param_groups[1:]``): its parameters,
    by ``named_parameters()`` names (a tuple) or a predicate ``name -> bool``, and the
    learning rate and weight decay it sets (None: the optimizer's)."""

    params: tuple[str, ...] | Callable[[str], bool]
    learning_rate: float | None = None
    weight_decay: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.params, (list, str)):
            names = (self.params,) if isinstance(self.params, str) else tuple(self.params)
            object.__setattr__(self, "params", names)
        if not callable(self.params) and not self.params:
            raise ValueError(f"ParamGroup params={self.params!r} must name parameters")
        for name in ("learning_rate", "weight_decay"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"ParamGroup {name}={value} must be >= 0 (or None)")

    def holds(self, name: str) -> bool:
        return bool(self.params(name)) if callable(self.params) else name in self.params


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
    ``groups``: torch's parameter groups after the first, each a :class:`ParamGroup`;
    the first holds every parameter no group holds, with the fields above.
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
    groups: tuple[ParamGroup, ...] = ()

    def __post_init__(self) -> None:
        # Mappings from dataclasses.asdict of jaxdp's OptimizerSpec, which mirrors this.
        groups = tuple(ParamGroup(**g) if isinstance(g, Mapping) else g for g in self.groups)
        object.__setattr__(self, "groups", groups)
        if not all(isinstance(g, ParamGroup) for g in groups):
            raise TypeError(f"groups={self.groups!r} must be ParamGroups")
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
    params: Iterable[torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]],
    cfg: OptimConfig,
    *,
    zero: bool = False,
) -> torch.optim.Optimizer:
    """``torch.optim.SGD`` (dampening 0) or ``torch.optim.AdamW`` with ``cfg``'s settings.

    ``params``: ``model.parameters()``, or ``model.named_parameters()`` (needed by
    ``cfg.groups``: each group takes the parameters it names, the first group the rest,
    in the model's order).

    ``zero=True``: the same optimizer inside
    ``torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class=...)``
    (needs a process group). Each rank owns whole parameters (largest first, each
    to the rank holding the fewest elements so far), keeps only their state, steps
    only them, and broadcasts them to the other ranks after its step.
    """
    optimizer_class, settings = _torch_optimizer(cfg)
    params = _param_groups(list(params), cfg)
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


def _param_groups(params: list[Any], cfg: OptimConfig) -> list[Any]:
    """The parameters, or torch's param groups (dicts) for ``cfg.groups``."""
    named = bool(params) and all(isinstance(p, tuple) for p in params)
    if not cfg.groups:
        return [p for _, p in params] if named else params
    if not named:
        raise ValueError(
            "OptimConfig.groups names parameters: pass model.named_parameters(), not "
            "model.parameters()"
        )
    members: list[list[Any]] = [[] for _ in range(len(cfg.groups) + 1)]
    for name, p in params:
        members[next((i + 1 for i, g in enumerate(cfg.groups) if g.holds(name)), 0)].append(p)
    names = [name for name, _ in params]
    for i, group in enumerate(cfg.groups):
        missing = [] if callable(group.params) else sorted(set(group.params) - set(names))
        if missing:
            raise ValueError(f"groups[{i}] names {missing}, which the model has not: {names}")
    out = [{"params": members[0]}]
    for group, held in zip(cfg.groups, members[1:], strict=True):
        own = {"lr": group.learning_rate, "weight_decay": group.weight_decay}
        out.append({"params": held, **{k: v for k, v in own.items() if v is not None}})
    return out


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

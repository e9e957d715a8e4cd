"""A user's own model and loss in torch_ref: import specs, factories and the named losses.

A model is a reference name (``torch_ref.MODELS``), a ``"MODULE:ATTR"`` spec,
a callable that returns an ``nn.Module`` (a class or a factory taking no
arguments) or an ``nn.Module`` (deep-copied). DDP ranks are separate processes,
so whatever names the model must reach them: a spec is imported again in each
rank, a callable travels by reference (its module must be importable there: a
spawned rank gets this process's ``sys.path``), a module travels pickled.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LOSSES = ("mse", "cross_entropy")
"""The named losses: ``F.mse_loss(out, y)`` and ``F.cross_entropy`` over the last axis."""

TorchLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def load_attr(spec: str) -> Any:
    """The object a ``"MODULE:ATTR"`` spec names.

    MODULE is a dotted module name or a path to a ``.py`` file (imported once,
    as a module named after the file unless that name is taken, with its folder
    on ``sys.path`` while it runs, so its imports of the files beside it work as
    under ``python FILE``); ATTR may be dotted (``"models.py:Net.small"``).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"spec={spec!r} must be 'MODULE:ATTR' (MODULE a module or a .py path)")
    module = _import(module_name)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"spec={spec!r}: {obj.__name__!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def _import(name: str) -> Any:
    if not name.endswith(".py"):
        return importlib.import_module(name)
    path = Path(name).resolve()
    if not path.is_file():
        raise ValueError(f"spec module {name!r} is not a file")
    # The file's own name, as `python FILE` would import its neighbours, unless another
    # module has it (then a name of its own).
    module_name = path.stem
    known = sys.modules.get(module_name)
    if known is not None and Path(getattr(known, "__file__", "") or "").resolve() == path:
        return known
    if known is not None:
        module_name = f"_torch_ref_user_{abs(hash(str(path))):x}_{path.stem}"
        if module_name in sys.modules:
            return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    # Its folder on the path while it runs, as `python FILE` has it: the file's own
    # imports of its neighbours (`from blocks import Block`) find them.
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    finally:
        sys.path.remove(str(path.parent))
    return module


def is_user_model(model: Any) -> bool:
    """True for anything but a reference model name."""
    return not isinstance(model, str) or ":" in model


def check_user_model(model: Any) -> None:
    """Raises ``TypeError`` unless ``model`` is a spec, a callable or an ``nn.Module``."""
    if not (isinstance(model, (str, nn.Module)) or callable(model)):
        raise TypeError(
            f"model={model!r} must be a 'MODULE:ATTR' spec, a class or factory returning an "
            "nn.Module, or an nn.Module"
        )


def build_user_model(model: Any, *, seed: int, dtype: torch.dtype) -> nn.Module:
    """A fresh copy of a user's model: ``torch.manual_seed(seed)``, build, cast to ``dtype``."""
    check_user_model(model)
    if isinstance(model, str):
        model = load_attr(model)
    torch.manual_seed(seed)
    module = copy.deepcopy(model) if isinstance(model, nn.Module) else model()
    if not isinstance(module, nn.Module):
        raise TypeError(f"model factory {model!r} returned {type(module).__name__}, not nn.Module")
    return module.to(dtype)


def loss_function(loss: Any) -> TorchLoss:
    """``loss(output, y) -> scalar`` for a named loss, a ``"MODULE:ATTR"`` spec or a callable."""
    if loss == "mse":
        return F.mse_loss
    if loss == "cross_entropy":
        return _cross_entropy
    if isinstance(loss, str):
        if ":" not in loss:
            raise ValueError(f"loss={loss!r} must be one of {LOSSES} or a 'MODULE:ATTR' spec")
        loss = load_attr(loss)
    if not callable(loss):
        raise TypeError(f"loss={loss!r} must be callable as loss(output, y)")
    return loss


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits over the last axis (any leading axes, e.g. tokens)."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def scheduler_factory(scheduler: Any) -> Callable[[torch.optim.Optimizer], Any]:
    """``optimizer -> LRScheduler`` from a factory or a ``"MODULE:ATTR"`` spec of one."""
    if isinstance(scheduler, str):
        if ":" not in scheduler:
            raise ValueError(
                f"lr_scheduler={scheduler!r} must be a 'MODULE:ATTR' spec of a factory "
                "optimizer -> LRScheduler"
            )
        scheduler = load_attr(scheduler)
    if not callable(scheduler):
        raise TypeError(
            f"lr_scheduler={scheduler!r} must be a factory optimizer -> LRScheduler "
            "(e.g. lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f))"
        )
    return scheduler

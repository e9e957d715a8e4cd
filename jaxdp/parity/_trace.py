"""Every submodule's input and output in one forward pass of a torch model and its NNX port,
and the innermost submodule that computes differently from the same input.

torch records through forward hooks; the NNX side runs eagerly with the ``__call__`` of
its submodules' classes wrapped for the pass (and restored after it). Modules are
matched by path; an activation is compared as it is, or with torch's channel axis 1
moved last (NCHW against NHWC).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
from flax import nnx

from ._mapping import dotted

# Modules listed after the one that first differs.
MORE_LINES = 3


@dataclasses.dataclass(frozen=True)
class Call:
    """A module's first call in a forward pass: its first argument and its output."""

    path: str  # dotted, "" for the model itself
    input: np.ndarray | None
    output: np.ndarray | None


def torch_calls(model: Any, x: Any) -> tuple[Any, list[Call]]:
    """``(output, calls)`` of ``model(x)``; calls in the order the modules finish."""
    calls: dict[str, Call] = {}
    handles = []
    for path, module in model.named_modules():

        def hook(module, args, output, path=path):
            if path not in calls:
                calls[path] = Call(path, _array(args[0] if args else None), _array(output))

        handles.append(module.register_forward_hook(hook))
    try:
        out = model(x)
    finally:
        for handle in handles:
            handle.remove()
    return out, list(calls.values())


def jax_calls(model: nnx.Module, x: Any) -> tuple[Any, dict[str, Call]]:
    """``(output, calls by path)`` of ``model(x)``, run eagerly."""
    paths = {id(m): dotted(p) for p, m in nnx.iter_modules(model)}
    calls: dict[str, Call] = {}
    active: set[int] = set()

    def record(call):
        def wrapper(self, *args, **kwargs):
            key = id(self)
            if key in active or key not in paths:  # a super().__call__, or another model
                return call(self, *args, **kwargs)
            active.add(key)
            try:
                out = call(self, *args, **kwargs)
            finally:
                active.discard(key)
            path = paths[key]
            if path not in calls:
                calls[path] = Call(path, _array(args[0] if args else None), _array(out))
            return out

        return wrapper

    with _wrapped({type(m) for _, m in nnx.iter_modules(model)}, record):
        out = model(x)
    return out, calls


@contextlib.contextmanager
def _wrapped(classes: set[type], record: Any) -> Iterator[None]:
    # Only classes whose instances are callable (a class without __call__ would find the
    # metaclass's, which constructs).
    classes = {c for c in classes if any("__call__" in k.__dict__ for k in c.__mro__)}
    saved = {cls: cls.__dict__.get("__call__") for cls in classes}
    try:
        for cls in classes:
            cls.__call__ = record(cls.__call__)
        yield
    finally:
        for cls, own in saved.items():
            if own is None:
                del cls.__call__
            else:
                cls.__call__ = own


def culprit(
    torch_side: list[Call], jax_side: dict[str, Call], rtol: float, atol: float
) -> tuple[str | None, list[str]]:
    """The first module (in torch's finishing order) with the same input on both sides
    and a different output: children finish before their parent, so it is the
    innermost one. Returns ``(path or None, one line per compared module up to it and
    a few after)``."""
    lines, found, after = [], None, 0
    for call in torch_side:
        twin = jax_side.get(call.path)
        if twin is None:
            continue
        inputs = differs(call.input, twin.input, rtol, atol)
        outputs = differs(call.output, twin.output, rtol, atol)
        if inputs is None or outputs is None:
            continue
        line = (
            f"  {call.path or '<model>':<24} input {_verdict(inputs)}, output {_verdict(outputs)}"
        )
        if call.output.dtype != twin.output.dtype:
            line += f" [computes in {twin.output.dtype}, torch in {call.output.dtype}]"
        lines.append(line)
        if found is None and not inputs[0] and outputs[0]:
            found = call.path
        elif found is not None:
            after += 1
            if after == MORE_LINES:
                lines.append("  ...")
                break
    return found, lines


def differs(
    theirs: np.ndarray | None, ours: np.ndarray | None, rtol: float, atol: float
) -> tuple[bool, float] | None:
    """``(beyond tolerance, max relative difference)`` of two activations, None if their
    layouts do not match."""
    if theirs is None or ours is None:
        return None
    if theirs.shape != ours.shape:
        if theirs.ndim < 3 or np.moveaxis(theirs, 1, -1).shape != ours.shape:
            return None
        theirs = np.moveaxis(theirs, 1, -1)
    if not (np.issubdtype(theirs.dtype, np.number) and np.issubdtype(ours.dtype, np.number)):
        return None
    a, b = ours.astype(np.float64), theirs.astype(np.float64)
    diff = np.abs(a - b)
    rel = float((diff / np.maximum(np.abs(b), np.finfo(np.float64).tiny)).max(initial=0.0))
    return bool(np.any(diff > atol + rtol * np.abs(b))), rel


def _verdict(result: tuple[bool, float]) -> str:
    return f"{'DIFFERS' if result[0] else 'agrees '} (max rel {result[1]:.1e})"


def _array(value: Any) -> np.ndarray | None:
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return np.asarray(value)
    return None

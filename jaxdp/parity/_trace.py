"""Every submodule's input and output in one forward pass of a torch model and its JAX port,
and the innermost submodule that computes differently from the same input.

torch records through forward hooks. The port runs eagerly: an NNX or equinox port with
the ``__call__`` of its submodules' classes wrapped for the pass (and restored after
it), an equinox port one example at a time (its records stacked into a batch), a Linen
port under ``flax.linen.intercept_methods``. Modules are matched by path; an activation
is compared as it is, or with torch's channel axis 1 moved last (NCHW against NHWC).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from flax import linen, nnx

from .._frozen import _named
from ._frameworks import EQUINOX, LINEN, framework_of, linen_forward

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


def jax_calls(model: Any, x: Any) -> tuple[Any, dict[str, Call]]:
    """``(output, calls by path)`` of the port's training-mode forward on ``x``, run eagerly."""
    framework = framework_of(model)
    if framework is LINEN:
        return _linen_calls(model, x)
    if framework is EQUINOX:
        modules = _equinox_modules(model)
        rows = [_module_calls(model, modules, row) for row in x]
        output = np.stack([np.asarray(out) for out, _ in rows])
        return output, {path: _stack([calls[path] for _, calls in rows]) for path in rows[0][1]}
    modules = {id(m): (".".join(map(str, p)), m) for p, m in nnx.iter_modules(model)}
    return _module_calls(model, modules, x)


def _module_calls(
    model: Any, modules: dict[int, tuple[str, Any]], x: Any
) -> tuple[Any, dict[str, Call]]:
    """``model(x)`` with the first call of each of ``modules`` (id -> (dotted path,
    module)) recorded."""
    calls: dict[str, Call] = {}
    active: set[int] = set()

    def record(call):
        def wrapper(self, *args, **kwargs):
            key = id(self)
            if key in active or key not in modules:  # a super().__call__, or another model
                return call(self, *args, **kwargs)
            active.add(key)
            try:
                out = call(self, *args, **kwargs)
            finally:
                active.discard(key)
            path = modules[key][0]
            if path not in calls:
                calls[path] = Call(path, _array(args[0] if args else None), _array(out))
            return out

        return wrapper

    with _wrapped({type(m) for _, m in modules.values()}, record):
        out = model(x)
    return out, calls


def _equinox_modules(model: Any) -> dict[int, tuple[str, Any]]:
    """Every equinox module inside ``model`` (fields, lists, dicts), by dotted path."""
    import equinox as eqx

    found = {id(model): ("", model)}

    def visit(node: Any, prefix: str) -> None:
        children = jax.tree_util.tree_flatten_with_path(
            node, is_leaf=lambda n: n is not node and isinstance(n, eqx.Module)
        )[0]
        for path, child in children:
            if isinstance(child, eqx.Module) and id(child) not in found:
                name = prefix + ".".join(_named(path))
                found[id(child)] = (name, child)
                visit(child, name + ".")

    visit(model, "")
    return found


def _stack(calls: list[Call]) -> Call:
    """One example's calls, stacked into the batch's."""

    def stack(arrays: list[np.ndarray | None]) -> np.ndarray | None:
        return None if any(a is None for a in arrays) else np.stack(arrays)

    return Call(calls[0].path, stack([c.input for c in calls]), stack([c.output for c in calls]))


def _linen_calls(model: linen.Module, x: Any) -> tuple[Any, dict[str, Call]]:
    """A bound Linen module's training-mode forward (batch statistics updated in a copy),
    each submodule's first ``__call__`` recorded through ``linen.intercept_methods``."""
    calls: dict[str, Call] = {}

    def intercept(call, args, kwargs, context):
        out = call(*args, **kwargs)
        path = ".".join(context.module.path)
        if context.method_name == "__call__" and path not in calls:
            calls[path] = Call(path, _array(args[0] if args else None), _array(out))
        return out

    module, variables = model.unbind()
    with linen.intercept_methods(intercept):
        out = linen_forward(module, dict(variables), x)
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

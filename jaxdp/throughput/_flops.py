"""FLOPs of a step from its traced program, every loop counted as many times as it runs."""

from __future__ import annotations

import math
import warnings
from typing import Any

from jax.extend import core as jex_core

from .._step import TrainStep


def step_flops(step: TrainStep, state: Any, batch: Any, micro_weights: Any = None) -> float:
    """FLOPs of one optimizer step of ``step`` on ``batch``, over all its devices.

    Counted from the traced program (:meth:`TrainStep.trace`; ``state`` and ``batch`` as
    :meth:`TrainStep.lower` takes them, arrays or ``jax.ShapeDtypeStruct``, nothing
    runs): every ``dot_general`` (2 x output size x contracted size) and
    ``conv_general_dilated``, as the program computes them (a rematerialized forward
    counts again), each ``lax.scan`` body times its length (the micro-batch loop K
    times, ``jaxdp.scan_layers`` once per layer), the body of a ``shard_map`` times its
    devices, and of a ``lax.cond`` the costlier branch (the update applied). Elementwise
    work (the optimizer, activations) is not counted: the convention of MFU figures
    (PaLM's, MaxText's), where matmuls are nearly all the arithmetic. On the
    ``multisteps`` path a call is one micro-batch, so a step is ``accum_steps`` calls.
    A ``while_loop`` of the user's own has no known length and counts once, with a
    warning.
    """
    counter = _Counter()
    flops = counter.count(step.trace(state, batch, micro_weights).jaxpr.jaxpr)
    if counter.while_loops:
        warnings.warn(
            f"step_flops: {counter.while_loops} while_loop(s) in the step have no known "
            "length and are counted once; use lax.scan (or fori_loop with static bounds)",
            stacklevel=2,
        )
    return float(flops * (step.accum_steps if step.path == "multisteps" else 1))


class _Counter:
    def __init__(self) -> None:
        self.while_loops = 0

    def count(self, jaxpr: Any) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "dot_general":
                total += _dot(eqn)
            elif name == "conv_general_dilated":
                total += _conv(eqn)
            elif name == "scan":
                total += eqn.params["length"] * self.count(_open(eqn.params["jaxpr"]))
            elif name == "cond":
                total += max(self.count(_open(b)) for b in eqn.params["branches"])
            elif name == "while":
                self.while_loops += 1
                total += self.count(_open(eqn.params["body_jaxpr"]))
            elif name == "shard_map":
                total += eqn.params["mesh"].size * self.count(_open(eqn.params["jaxpr"]))
            else:  # pjit, custom_vjp/jvp calls, remat, ...: their inner programs once
                total += sum(self.count(_open(j)) for j in _inner(eqn.params))
        return total


def _open(jaxpr: Any) -> Any:
    return jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr


def _inner(params: dict[str, Any]) -> list[Any]:
    found = []
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
                found.append(v)
    return found


def _dot(eqn: Any) -> int:
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    out = eqn.outvars[0].aval.shape
    return 2 * math.prod(out) * math.prod(lhs[d] for d in contract)


def _conv(eqn: Any) -> int:
    rhs = eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2 * math.prod(out) * math.prod(rhs) // out_features

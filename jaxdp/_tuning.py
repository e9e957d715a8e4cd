"""How the step is made fast on one backend, apart from what it computes.

The pipeline states its meaning (the mean of the gradient sums; skip a non-finite
update; add a micro-batch into the window; start the next window at zero) and calls a
:class:`Tuning` for the spelling. Each choice below was measured on XLA:CPU, and only
a CPU mesh takes it: every other backend gets the plain spelling, which means the same
(docs/decisions.md, "Tuning kept apart").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class Tuning:
    cpu: bool

    def mean(self, sums: Any, weight: jax.Array, like: Any) -> Any:
        """``sums / weight`` in the dtypes of ``like``.

        CPU: a multiply by ``1 / weight``, which XLA repeats inside each consumer
        (AdamW's two moment updates), where it computed a divide once and wrote it
        out: a pass over the gradients, 0.4 ms of a 4.3 ms MLP step. At most one
        rounding apart from the divide, none for a power-of-two weight.
        """
        if self.cpu:
            inverse = 1 / weight
            return jax.tree.map(
                lambda g, p: (g * inverse.astype(g.dtype)).astype(p.dtype), sums, like
            )
        return jax.tree.map(lambda g, p: (g / weight.astype(g.dtype)).astype(p.dtype), sums, like)

    def skip(self, ok: jax.Array, apply: Callable[[Any], Any], operands: Any, like: Any) -> Any:
        """``apply(operands)`` if ``ok``, else ``operands`` (cast like ``like``).

        CPU: a ``lax.cond``: a select over parameters and optimizer state cost 1.3 ms
        of a 6.6 ms MLP step; a branch not taken costs nothing. Elsewhere a select:
        a conditional reads its predicate on the host (XLA:GPU), a round trip per
        step, where the select is a pass at memory speed (not measured: no GPU was lent).
        """
        if self.cpu:
            return jax.lax.cond(ok, apply, lambda x: _cast_like(like, x), operands)
        kept = _cast_like(like, operands)
        return jax.tree.map(lambda a, b: jnp.where(ok, a, b), apply(operands), kept)

    def add(self, block: Any, grads: Any) -> Any:
        """A device's window sums (its ``[1, ...]`` block of a per-device leaf, or its
        block of a leaf split at ZeRO stage 2) plus this micro-batch's gradients.

        Added in the block's own shape: XLA:CPU adds in place into the donated buffer
        only then (tests/core/test_streaming_program.py: no copy of a parameter's size
        in a call that does not end the window). One spelling on every backend: the
        reshape is a bitcast, which costs nothing anywhere.
        """
        return jax.tree.map(lambda a, g: a + g.reshape(a.shape), block, grads)

    def reset(self, ends: jax.Array, sums: Any, after: jax.Array) -> Any:
        """The window's sums, zero where ``ends``; ``after`` (the update's gradient
        norm) orders the reset after the update read them.

        CPU: zeros computed from the sums (``where(finite, abs(a) * 0, 0)``: +0 for
        every element, NaN and Inf included), in a branch of their own: fresh zeros,
        or a reset inside the update's branch, made XLA:CPU copy the sums on every
        call, the ones that do not end the window included.
        """
        if self.cpu:
            return jax.lax.cond(ends, _zeros_from, lambda o: o[0], (sums, after))
        return jax.lax.cond(ends, lambda s: jax.tree.map(jnp.zeros_like, s), lambda s: s, sums)


def _zeros_from(operands: tuple[Any, jax.Array]) -> Any:
    sums, after = operands
    ordered = jnp.isfinite(after)

    def zero(a):
        return jnp.where(ordered & jnp.isfinite(a), jnp.abs(a) * 0, 0).astype(a.dtype)

    return jax.tree.map(zero, sums)


def _cast_like(like: Any, tree: Any) -> Any:
    return jax.tree.map(lambda o, x: x.astype(o.dtype), like, tree)


def tuning_for(mesh: Mesh) -> Tuning:
    """The tuning of ``mesh``'s backend."""
    return Tuning(cpu=mesh.devices.flat[0].platform == "cpu")

"""The end of an optimizer step at ZeRO stage 1 or 2: reduce-scatter, the optimizer on
this device's shard, all-gather. Same interface as :class:`jaxdp._accumulate.StepEnd`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._accumulate import Update, cast_like, select, updated_like
from ._model_state import device0, from_wire
from ._sync import SyncState, all_finite, mean_grads
from ._zero import ShardLayout


class ShardedEnd(NamedTuple):
    """Stage 1: ``grad_sum`` is this device's whole sum, reduce-scattered here (ONE
    collective). Stage 2: it is already this device's shard of the global sum (each
    micro-batch was reduce-scattered). Then one scalar psum carries the shard's sum
    of squares (the global gradient norm: the metric, the non-finite check), the
    loss and weight sums and device 0's batch statistics; the optimizer updates
    this device's shard of the parameters with its shard of the state, and ONE
    all-gather (per parameter dtype) returns the whole parameters."""

    axis_name: str
    dtype: Any  # of the accumulators, and of the loss and norm the SyncState keeps
    skip_nonfinite: bool
    layout: ShardLayout
    stage: int
    comm_dtype: Any = None
    num_devices: int = 1

    def micro_sync(self, grads: Any) -> Any:
        """Stage 2: one micro-batch's gradients into this device's shard of their sum."""
        return self.layout.reduce_scatter(grads, self.axis_name, self.comm_dtype)

    def __call__(
        self,
        optimizer: optax.GradientTransformation,
        params: Any,
        opt_state: Any,
        batch_stats: Any,
        grad_sum: Any,
        loss_sum: jax.Array,
        weight: jax.Array,
        stats: Any,
    ) -> tuple[Update, SyncState]:
        axis = self.axis_name
        if self.stage == 1:
            grad_sum = self.layout.reduce_scatter(grad_sum, axis, self.comm_dtype)
        squares = sum(
            (jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grad_sum)), jnp.zeros([], self.dtype)
        )
        wire = device0(stats, axis, self.dtype)
        squares, loss_sum, weight, wire = jax.lax.psum((squares, loss_sum, weight, wire), axis)
        loss = loss_sum / weight.astype(loss_sum.dtype)
        grad_norm = jnp.sqrt(squares) / weight
        finite = all_finite(grad_norm, loss, wire)
        ok = finite if self.skip_nonfinite else jnp.ones([], bool)
        index = jax.lax.axis_index(axis)

        def apply(operands):
            params, opt_state = operands
            mine = self.layout.shard(params, index)
            grads = mean_grads(grad_sum, weight, like=mine)
            updates, opt_state = optimizer.update(grads, opt_state, mine)
            return self.layout.all_gather(optax.apply_updates(mine, updates), axis), opt_state

        if self.skip_nonfinite:
            keep = functools.partial(cast_like, self.updated_like(optimizer, params, opt_state))
            new_params, new_opt_state = jax.lax.cond(ok, apply, keep, (params, opt_state))
        else:
            new_params, new_opt_state = apply((params, opt_state))
        new_stats = select(ok, from_wire(wire, batch_stats), batch_stats)
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite}
        sync = SyncState(loss.astype(self.dtype), grad_norm.astype(self.dtype), finite, wire)
        return Update(new_params, new_opt_state, new_stats, ok, ~ok, metrics), sync

    def updated_like(self, optimizer: Any, params: Any, opt_state: Any) -> Any:
        """Whole parameters as they are; the state as the optimizer returns it for a shard."""
        shard = self.layout.shard_like(params)
        return params, updated_like(optimizer, shard, opt_state)[1]

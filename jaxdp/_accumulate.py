"""Per-device step bodies: fused accumulation and the MultiSteps path.

Both run inside ``shard_map`` (or ``pmap``) on ONE device's data and state and
communicate only through :func:`jaxdp._sync.all_reduce_mean`, once per
optimizer step. They accumulate per-device SUMS of micro-batch gradients,
losses and weights, and divide by the global weight after the all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._sync import SyncState, all_reduce_mean

Parts = Callable[[Any, Any], tuple[jax.Array, jax.Array]]


class AccumState(NamedTuple):
    """Per-device sums of the open accumulation window (``multisteps`` path)."""

    loss_sum: jax.Array
    weight: jax.Array


def _value_and_grad(parts: Parts, params: Any, batch: Any, scale: jax.Array, dtype: Any):
    """Gradient, value and weight of one micro-batch, each times ``scale``.

    ``scale`` is the micro-batch's weight in its window: 1, or 0 for a padding
    micro-batch that fills an incomplete last window (it then adds nothing).
    """
    (value, weight), grads = jax.value_and_grad(parts, has_aux=True)(params, batch)
    scale = scale.astype(dtype)
    grads = jax.tree.map(lambda g: g.astype(dtype) * scale, grads)
    return grads, value.astype(dtype) * scale, weight.astype(dtype) * scale


def fused_update(
    parts: Parts,
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    micro_batches: Any,
    micro_weights: jax.Array,
    *,
    axis_name: str,
    dtype: Any,
    to_varying: Callable[[Any], Any],
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """One optimizer step over ``[accum_steps, micro_batch_size, ...]`` local data.

    ``micro_weights`` (``[accum_steps]``, the same on every device) scales each
    micro-batch's gradient, loss and weight; 0 marks padding.

    ``to_varying`` marks params as per-device before the loop. Without it
    (shard_map with check_vma) JAX treats replicated params as invariant and
    the transpose of their implicit broadcast is a psum: an all-reduce inside
    the scan body, i.e. one per micro-batch.
    """
    local_params = to_varying(params)

    def micro_step(carry, inputs):
        batch, scale = inputs
        grads, value, weight = _value_and_grad(parts, local_params, batch, scale, dtype)
        return jax.tree.map(jnp.add, carry, (grads, value, weight)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), params)
    init = to_varying((zeros, jnp.zeros([], dtype), jnp.zeros([], dtype)))
    (grad_sum, loss_sum, weight), _ = jax.lax.scan(micro_step, init, (micro_batches, micro_weights))
    grads, loss = all_reduce_mean(grad_sum, loss_sum, weight, axis_name)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    return params, opt_state, metrics


def multisteps_update(
    parts: Parts,
    optimizer: optax.MultiSteps,
    params: Any,
    opt_state: optax.MultiStepsState,
    accum: AccumState,
    batch: Any,
    micro_weight: jax.Array,
    *,
    accum_steps: int,
    dtype: Any,
    to_varying: Callable[[Any], Any],
) -> tuple[Any, Any, AccumState, dict[str, jax.Array]]:
    """One micro-batch through ``optax.MultiSteps``; syncs only when emitting.

    ``optimizer`` wraps ``chain(sync_on_emit(), user_optimizer)`` with
    ``use_grad_mean=False``. ``emit`` comes from the replicated mini-step
    counter, so every device takes the same branch of the guarded all-reduce.
    ``micro_weight`` scales this micro-batch (0: padding of a last window).
    """
    grads, value, weight = _value_and_grad(parts, to_varying(params), batch, micro_weight, dtype)
    loss_sum, weight = accum.loss_sum + value, accum.weight + weight
    emit = opt_state.mini_step == accum_steps - 1
    updates, opt_state = optimizer.update(
        grads, opt_state, params, emit=emit, loss_sum=loss_sum, weight=weight
    )
    params = optax.apply_updates(params, updates)
    accum = AccumState(*(jnp.where(emit, jnp.zeros_like(x), x) for x in (loss_sum, weight)))
    sync = find_state(opt_state.inner_opt_state, SyncState)
    metrics = {"loss": sync.loss, "grad_norm": sync.grad_norm, "emitted": emit}
    return params, opt_state, accum, metrics


def find_state(opt_state: Any, kind: type) -> Any:
    """The first node of type ``kind`` in an optimizer state, or None."""
    nodes = jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, kind))
    return next((node for node in nodes if isinstance(node, kind)), None)


def learning_rate(opt_state: Any) -> jax.Array | None:
    """The learning rate held by ``optax.inject_hyperparams`` state, if any."""
    nodes = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(getattr(x, "hyperparams", None), dict)
    )
    for node in nodes:
        hyperparams = getattr(node, "hyperparams", None)
        if isinstance(hyperparams, dict) and "learning_rate" in hyperparams:
            return hyperparams["learning_rate"]
    return None

"""The floor jaxdp's step is compared with: a data-parallel step written by hand.

``shard_map`` over the mesh, a ``lax.scan`` over the device's micro-batches that
sums gradients and losses, one ``pmean`` of them, the optimizer: about the 40
lines anyone would write for one model and one optimizer, without jaxdp's
conveniences (non-finite skips, weighted losses, batch statistics, rng keys,
frozen parameters, metrics, the multisteps path, checks). What jaxdp costs on
top of it is what those conveniences cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def hand_written_step(
    loss: Callable[[Any, Any], jax.Array],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    accum_steps: int,
) -> Callable[[Any, Any, Any], tuple[Any, Any, jax.Array]]:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``, jitted, the state
    donated; ``batch`` holds ``accum_steps`` micro-batches per device, device-major."""
    axis = mesh.axis_names[0]

    def local(params, opt_state, batch):
        micro = jax.tree.map(lambda x: x.reshape(accum_steps, -1, *x.shape[1:]), batch)
        # Per-device parameters: the gradient of replicated ones would be psummed
        # in every micro-batch (jaxdp's design notes, the first trap).
        varying = jax.lax.pcast(params, axis, to="varying")

        def body(sums, batch):
            value, grads = jax.value_and_grad(loss)(varying, batch)
            return jax.tree.map(jnp.add, sums, (value, grads)), None

        zeros = (jnp.zeros([]), jax.tree.map(jnp.zeros_like, params))
        (value, grads), _ = jax.lax.scan(body, jax.lax.pcast(zeros, axis, to="varying"), micro)
        value, grads = jax.lax.pmean((value, grads), axis)  # the one all-reduce
        grads = jax.tree.map(lambda g: g / accum_steps, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value / accum_steps

    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P(), P(axis)), out_specs=(P(), P(), P())
    )
    return jax.jit(mapped, donate_argnums=(0, 1))


def replicated(mesh: Mesh, tree: Any) -> Any:
    """``tree`` placed whole on every device of ``mesh``, as :func:`hand_written_step`
    returns its parameters and optimizer state: its first call then compiles the one
    program every call runs (from arrays placed otherwise, the second call compiles
    it again: the arrays' types name the mesh after the first)."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def hand_written_streaming(
    loss: Callable[[Any, Any], jax.Array],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    accum_steps: int,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The least a step fed one micro-batch per call can do: ``(accumulate, apply)``,
    both jitted. ``accumulate(sums, params, micro) -> (sums, loss)`` adds one
    micro-batch's gradients into ``sums`` (donated; each device's own, stacked on a
    leading axis: start from ``zeros([num_devices, *shape])`` per parameter);
    ``apply(params, opt_state, sums)`` makes the one ``pmean``, the update and fresh
    zero sums. ``accum_steps`` calls of the first and one of the second: ``K + 1``
    launches where the fused step makes one, and no skip, weights, counters or checks."""
    axis = mesh.axis_names[0]

    def local_accumulate(sums, params, micro):
        varying = jax.lax.pcast(params, axis, to="varying")
        value, grads = jax.value_and_grad(loss)(varying, micro)
        return jax.tree.map(lambda s, g: s + g[None], sums, grads), jax.lax.pmean(value, axis)

    def local_apply(params, opt_state, sums):
        grads = jax.tree.map(lambda g: g[0] / accum_steps, jax.lax.pmean(sums, axis))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.tree.map(jnp.zeros_like, sums)

    accumulate = jax.shard_map(
        local_accumulate, mesh=mesh, in_specs=(P(axis), P(), P(axis)), out_specs=(P(axis), P())
    )
    apply = jax.shard_map(
        local_apply, mesh=mesh, in_specs=(P(), P(), P(axis)), out_specs=(P(), P(), P(axis))
    )
    return jax.jit(accumulate, donate_argnums=0), jax.jit(apply, donate_argnums=(0, 1, 2))

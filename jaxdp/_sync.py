"""Gradient synchronization: the one all-reduce per optimizer step."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ._mesh import DATA_AXIS


def mark_varying(tree: Any, axis_name: str = DATA_AXIS) -> Any:
    """Marks replicated values as per-device inside ``shard_map(check_vma=True)``.

    Differentiating w.r.t. such values gives each device its LOCAL gradient;
    w.r.t. the unmarked (invariant) values JAX would psum the gradient itself.
    """
    pcast = getattr(jax.lax, "pcast", None)
    if pcast is not None:
        return pcast(tree, axis_name, to="varying")
    return jax.lax.pvary(tree, axis_name)  # the name before jax 0.10


def all_reduce_mean(
    grad_sum: Any, loss_sum: jax.Array, weight: jax.Array, axis_name: str = DATA_AXIS
) -> tuple[Any, jax.Array]:
    """Global weighted means of gradients and loss from per-device sums.

    Every device passes the sums of its micro-batches' gradients and losses and
    their total weight; the result is ``sum over devices / total weight``. The
    three travel in ONE all-reduce (a single variadic psum), so the loss metric
    and the token count cost no extra collective.
    """
    grads, loss, _ = all_reduce_step(grad_sum, loss_sum, weight, (), axis_name)
    return grads, loss


def all_reduce_step(
    grad_sum: Any, loss_sum: jax.Array, weight: jax.Array, extra: Any, axis_name: str = DATA_AXIS
) -> tuple[Any, jax.Array, Any]:
    """:func:`all_reduce_mean` with ``extra`` summed over devices in the same psum.

    jaxdp passes device 0's batch statistics as ``extra`` (zeros elsewhere),
    so committing them costs their bytes in the one all-reduce, not a
    collective of their own.
    """
    grad_sum, loss_sum, weight, extra = jax.lax.psum((grad_sum, loss_sum, weight, extra), axis_name)
    grads = jax.tree.map(lambda g: (g / weight.astype(g.dtype)).astype(g.dtype), grad_sum)
    return grads, loss_sum / weight.astype(loss_sum.dtype), extra


def all_finite(grads: Any, loss: jax.Array, extra: Any = ()) -> jax.Array:
    """True when the all-reduced gradients, loss and ``extra`` hold no NaN or Inf.

    Decided after the all-reduce, so every device decides the same: a NaN or
    Inf on any device (or an overflow of the sum) makes the sum non-finite.
    ``extra`` is the rest of the payload (the batch statistics to commit).
    """
    leaves = jax.tree.leaves((grads, extra))
    flags = [jnp.all(jnp.isfinite(g)) for g in leaves if jnp.issubdtype(g.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.isfinite(loss), *flags]))


class SyncState(NamedTuple):
    """Metrics of the last synchronized step, kept in the optimizer state.

    Inside ``optax.MultiSteps`` this state only advances on emitting steps, so
    it always describes the last optimizer update.
    """

    loss: jax.Array
    grad_norm: jax.Array
    finite: jax.Array  # gradients and loss free of NaN and Inf (see all_finite)
    extra: Any = ()  # the all-reduced ``extra`` (jaxdp: device 0's batch statistics)


def sync_on_emit(
    axis_name: str = DATA_AXIS, *, dtype: Any = jnp.float32, extra_like: Any = ()
) -> optax.GradientTransformationExtraArgs:
    """All-reduces accumulated gradients only on the step that emits an update.

    Meant as the first link of the chain wrapped by ``optax.MultiSteps`` with
    ``use_grad_mean=False``: it receives the per-device SUM of micro-batch
    gradients and needs, as extra arguments, ``emit`` (a replicated bool),
    ``loss_sum`` and ``weight`` (per-device sums over the window), and
    optionally ``extra``, a tree shaped like ``extra_like`` summed over
    devices in the same psum. The loss and gradient norm of the last emitted
    step are kept in ``dtype``, with whether it was finite and the summed
    ``extra``.

    MultiSteps (optax 0.2.8) runs its inner chain on every mini-step and masks
    the result, so an unguarded psum here would run every micro-batch. The
    ``lax.cond`` makes the all-reduce run only when ``emit`` is true; the other
    branch returns zeros that MultiSteps discards.
    """

    def init(params: Any) -> SyncState:
        del params
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), extra_like)
        return SyncState(jnp.zeros([], dtype), jnp.zeros([], dtype), jnp.ones([], bool), zeros)

    def update(updates, state, params=None, *, emit, loss_sum, weight, extra=(), **unused):
        del unused
        # Gradients leave in the parameters' dtypes, as in the fused path.
        dtypes = (
            jax.tree.map(lambda g: g.dtype, updates)
            if params is None
            else (jax.tree.map(lambda p: p.dtype, params))
        )

        def reduce(operands):
            grads, loss, summed = all_reduce_step(*operands, axis_name)
            finite = all_finite(grads, loss, summed)
            grads = jax.tree.map(lambda g, d: g.astype(d), grads, dtypes)
            norm = optax.tree.norm(grads).astype(dtype)
            return grads, SyncState(loss.astype(dtype), norm, finite, summed)

        def skip(operands):
            # Fresh constants: replicated like the psum result, as lax.cond needs.
            zeros = jax.tree.map(lambda g, d: jnp.zeros(g.shape, d), operands[0], dtypes)
            return zeros, state

        return jax.lax.cond(emit, reduce, skip, (updates, loss_sum, weight, extra))

    return optax.GradientTransformationExtraArgs(init, update)


class ReplicaMismatchError(ValueError):
    """Replicas of a value that must be identical on every device differ."""


def _bits(x: jax.Array) -> jax.Array:
    """An integer view with the same bits, so -0.0 != 0.0 and NaN == NaN."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return _bits(jnp.stack([x.real, x.imag]))
    return x.astype(jnp.int32) if x.dtype == jnp.bool_ else x


def check_replicas(tree: Any, mesh: Mesh, *, name: str = "params") -> None:
    """Checks that every device holds bitwise the same copy of ``tree``.

    Broadcasts each leaf from replica 0 (a psum where only device 0 contributes)
    and compares each device's own copy with it. Costs one collective per leaf;
    run it once when training starts, not per step.

    Raises:
      ReplicaMismatchError: naming the first differing leaf and the devices.
    """
    axis = mesh.axis_names[0]
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        return

    def differs(*xs):
        first = jax.lax.axis_index(axis) == 0
        flags = []
        for x in xs:
            bits = _bits(x)
            ref = jax.lax.psum(jnp.where(first, bits, jnp.zeros_like(bits)), axis)
            # Gathered so the flags are replicated, hence readable on any process.
            flags.append(jax.lax.all_gather(jnp.any(bits != ref), axis))
        return flags

    # check_vma=False: each device must read its OWN copy of a "replicated"
    # input; that is the thing being checked.
    local = jax.shard_map(differs, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    flags = jax.jit(local)(*[leaf for _, leaf in leaves])
    for (path, _), flag in zip(leaves, flags, strict=True):
        per_device = np.asarray(flag)
        if per_device.any():
            devices = [int(d) for d in np.flatnonzero(per_device)]
            raise ReplicaMismatchError(
                f"{name}{jax.tree_util.keystr(path)} differs between replicas: "
                f"mesh device(s) {devices} hold other values than device 0; "
                "initialize every process from the same seed or broadcast the values"
            )

"""Gradient synchronization: the one all-reduce per optimizer step."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ._mesh import DATA_AXIS
from ._zero import compress, decompress


def mark_varying(tree: Any, axis_name: str = DATA_AXIS) -> Any:
    """Marks replicated values as per-device inside ``shard_map(check_vma=True)``.

    Differentiating w.r.t. such values gives each device its LOCAL gradient;
    w.r.t. the unmarked (invariant) values JAX would psum the gradient itself.
    """
    pcast = getattr(jax.lax, "pcast", None)
    if pcast is not None:
        return pcast(tree, axis_name, to="varying")
    return jax.lax.pvary(tree, axis_name)  # the name before jax 0.10


def all_reduce_sums(
    grad_sum: Any,
    loss_sum: jax.Array,
    weight: jax.Array,
    extra: Any,
    axis_name: str = DATA_AXIS,
    comm_dtype: Any = None,
    num_devices: int = 1,
) -> tuple[Any, jax.Array, jax.Array, Any]:
    """The step's one psum: gradient sums, loss sum, weight and ``extra`` together.

    Returns ``(grad_sum, mean loss, total weight, extra)``, the gradients still
    global SUMS: dividing later, where the optimizer reads them, fuses the
    division into its pass over the gradients. jaxdp passes device 0's batch
    statistics as ``extra`` (zeros elsewhere), so committing them costs their
    bytes in the one all-reduce, not a collective of their own.

    ``comm_dtype`` (bfloat16) sends the gradients narrow, as torch's
    ``bf16_compress_hook``: divided by ``num_devices``, cast, summed, cast back
    and multiplied back; the loss, weight and ``extra`` keep their dtypes.
    """
    dtypes = [g.dtype for g in jax.tree.leaves(grad_sum)]
    grad_sum = jax.tree.map(lambda g: compress(g, comm_dtype, num_devices), grad_sum)
    grad_sum, loss_sum, weight, extra = jax.lax.psum((grad_sum, loss_sum, weight, extra), axis_name)
    leaves, treedef = jax.tree.flatten(grad_sum)
    grad_sum = treedef.unflatten(
        [decompress(g, d, comm_dtype, num_devices) for g, d in zip(leaves, dtypes, strict=True)]
    )
    return grad_sum, loss_sum / weight.astype(loss_sum.dtype), weight, extra


def mean_grads(grad_sum: Any, weight: jax.Array, like: Any = None) -> Any:
    """``grad_sum / weight``, in the dtypes of ``like`` (default: the sums').

    Computed as ``grad_sum * (1 / weight)``: XLA repeats a multiply inside each
    of its consumers (the optimizer's moment updates), but computes a divide
    once and writes it out, a pass over the gradients (0.4 ms of a 4.3 ms MLP
    step on XLA:CPU, docs/decisions.md). It differs from the divide by at most
    one rounding, and not at all when ``weight`` is a power of two.
    """
    like = grad_sum if like is None else like
    inverse = 1 / weight
    return jax.tree.map(lambda g, p: (g * inverse.astype(g.dtype)).astype(p.dtype), grad_sum, like)


def all_finite(grad_norm: jax.Array, loss: jax.Array, extra: Any = ()) -> jax.Array:
    """True when the all-reduced gradients (by their global norm), loss and ``extra``
    hold no NaN or Inf.

    Decided after the all-reduce, so every device decides the same: a NaN or
    Inf on any device (or an overflow of the sum) makes the sum non-finite.
    A NaN or Inf in any gradient makes the norm the step reports NaN or Inf,
    so no second pass over the gradients is needed; gradients so large that
    their squares overflow (above ~1.8e19 in float32) count as non-finite too.
    ``extra`` is the rest of the payload (the batch statistics to commit).
    """
    flags = [jnp.isfinite(grad_norm), jnp.isfinite(loss)]
    flags += [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(extra)]
    return jnp.all(jnp.stack(flags))


class SyncState(NamedTuple):
    """What the last synchronized step of the multisteps path all-reduced, kept in its
    optimizer state next to the user's optimizer's (``(SyncState, inner_state)``).

    It changes only on a call that applies an update, so every call of the next
    window reports that update's loss and gradient norm.
    """

    loss: jax.Array
    grad_norm: jax.Array
    finite: jax.Array  # gradients and loss free of NaN and Inf (see all_finite)
    extra: Any = ()  # the all-reduced ``extra`` (jaxdp: device 0's batch statistics)


class ReplicaMismatchError(ValueError):
    """Replicas of a value that must be identical on every device differ."""


def _bits(x: jax.Array) -> jax.Array:
    """An integer view with the same bits, so -0.0 != 0.0 and NaN == NaN."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return _bits(jnp.stack([x.real, x.imag]))
    return x.astype(jnp.int32) if x.dtype == jnp.bool_ else x


@functools.lru_cache(maxsize=8)
def _replica_check(mesh: Mesh) -> Any:
    """The jitted check for ``mesh``, built once: jit then compiles once per set of
    shapes, not at every ``TrainStep.init`` (a compile of over a second on 4 CPU devices)."""
    axis = mesh.axis_names[0]

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
    return jax.jit(jax.shard_map(differs, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))


def check_replicas(tree: Any, mesh: Mesh, *, name: str = "params") -> None:
    """Checks that every device holds bitwise the same copy of ``tree``.

    Broadcasts each leaf from replica 0 (a psum where only device 0 contributes)
    and compares each device's own copy with it. Costs one collective per leaf;
    run it once when training starts, not per step.

    Raises:
      ReplicaMismatchError: naming the first differing leaf and the devices.
    """
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves or mesh.devices.size == 1:  # one device, one copy: nothing to compile
        return
    flags = _replica_check(mesh)(*[leaf for _, leaf in leaves])
    for (path, _), flag in zip(leaves, flags, strict=True):
        per_device = np.asarray(flag)
        if per_device.any():
            devices = [int(d) for d in np.flatnonzero(per_device)]
            raise ReplicaMismatchError(
                f"{name}{jax.tree_util.keystr(path)} differs between replicas: "
                f"mesh device(s) {devices} hold other values than device 0; "
                "initialize every process from the same seed or broadcast the values"
            )

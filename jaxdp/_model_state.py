"""Model state through the step: batch statistics, randomness and the BatchNorm modes.

An NNX module's non-parameter variables fall in three groups:

- ``nnx.BatchStat`` (BatchNorm's running statistics, its counter): written by
  every training forward, carried from micro-batch to micro-batch on each
  device, and committed once per optimizer step as device 0's copy (see
  :func:`device0`), like DDP's ``broadcast_buffers=True``;
- ``nnx.RngState`` (the keys and counters of ``nnx.Rngs`` streams): never
  carried; every micro-batch re-derives each stream's key from its initial key
  (:func:`micro_key`), so a dropout mask depends on the seed, the optimizer
  step, the mesh device and the micro-batch only;
- everything else: read-only constants of the step (writing one is an error).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from ._model_kinds import is_linen_backed

BatchStats = Literal["local", "sync"]
"""How BatchNorm statistics are computed: ``"local"`` per device (DDP), ``"sync"`` over
all devices (SyncBatchNorm)."""


def split_state(model_state: Any) -> tuple[Any, Any, Any]:
    """``(batch_stats, rngs, constants)`` of an NNX module's non-parameter state."""
    if model_state is None:
        return None, None, None
    return nnx.split_state(model_state, nnx.BatchStat, nnx.RngState, ...)


def batch_norm_modules(model: Any) -> list[tuple[str, Any]]:
    """``(path, module)`` of every submodule with its own ``nnx.BatchStat`` and an ``axis_name``.

    These normalize with batch statistics (``nnx.BatchNorm``, :class:`jaxdp.models.BatchNorm`);
    their ``axis_name`` decides whether the statistics span devices. A Linen module
    (jaxdp's :class:`LinenModel` or flax's ``nnx.bridge.ToNNX``) with batch statistics
    counts as one; its Linen BatchNorms' ``axis_name`` is set as it runs.
    """
    if not isinstance(model, nnx.Module):
        return []
    found = []
    for path, module in nnx.iter_modules(model):
        if is_linen_backed(module):  # its Linen BatchNorms: see linen_batch_norms
            own = bool(jax.tree.leaves(nnx.state(module, nnx.BatchStat)))
        else:
            own = any(isinstance(v, nnx.BatchStat) for v in vars(module).values())
            own = own and hasattr(module, "axis_name")
        if own:
            found.append((".".join(map(str, path)) or "<root>", module))
    return found


def check_batch_stats(model: Any, mode: BatchStats | None, axis_name: str) -> None:
    """Fails early unless ``mode`` names how the model's batch statistics are computed."""
    found = batch_norm_modules(model)
    names = [name for name, _ in found]
    if mode is None and found:
        raise ValueError(
            f"the model normalizes with batch statistics ({', '.join(names)}); choose "
            "batch_stats='local' (each device its own micro-batch statistics, running "
            "statistics from device 0: DDP with broadcast_buffers=True) or batch_stats='sync' "
            "(statistics over all devices' micro-batches: SyncBatchNorm)"
        )
    if mode is not None and not found:
        raise ValueError(
            f"batch_stats={mode!r} but the model has no module with batch statistics "
            "(an nnx.BatchStat variable and an axis_name attribute, as nnx.BatchNorm)"
        )
    for name, module in found:
        if is_linen_backed(module):
            continue  # checked and set as its Linen BatchNorms run (linen_batch_norms)
        if mode == "local" and module.axis_name is not None:
            raise ValueError(
                f"{name} has axis_name={module.axis_name!r} (statistics across devices) but "
                "batch_stats='local'; build it with axis_name=None or use batch_stats='sync'"
            )
        if mode == "sync" and module.axis_name not in (None, axis_name):
            raise ValueError(
                f"{name} has axis_name={module.axis_name!r}; with batch_stats='sync' it must be "
                f"None or the mesh axis {axis_name!r} (jaxdp sets it)"
            )


def configure(model: Any, mode: BatchStats | None, axis_name: str) -> None:
    """Points the BatchNorm modules of a freshly merged (traced) module at the mesh axis."""
    if mode == "sync":
        for _, module in batch_norm_modules(model):
            if not is_linen_backed(module):
                module.axis_name = axis_name


def micro_key(key: jax.Array, step: Any, device: Any, micro_batch: Any) -> jax.Array:
    """``fold_in(fold_in(fold_in(key, step), device), micro_batch)``.

    ``step`` counts applied optimizer updates, ``device`` is the global mesh
    index (``lax.axis_index``, the same however many processes share the mesh)
    and ``micro_batch`` the position in the accumulation window.
    """
    return jax.random.fold_in(
        jax.random.fold_in(jax.random.fold_in(key, step), device), micro_batch
    )


def reseed(rngs: Any, step: Any, device: Any, micro_batch: Any) -> Any:
    """Every ``nnx.Rngs`` stream keyed by :func:`micro_key` of its own key, its count at 0."""
    if rngs is None:
        return None
    flat = []
    for path, var in nnx.to_flat_state(rngs):
        if isinstance(var, nnx.RngKey):
            var = var.replace(micro_key(var.get_value(), step, device, micro_batch))
        elif isinstance(var, nnx.RngCount):
            var = var.replace(jnp.zeros_like(var.get_value()))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def written_batch_stats(model: Any, constants: Any) -> Any:
    """The module's batch statistics after a forward; raises if it wrote a constant."""
    after = dict(nnx.to_flat_state(nnx.state(model)))
    for path, var in nnx.to_flat_state(constants):
        now = after.get(path)
        if now is not None and now.get_value() is not var.get_value():
            name = ".".join(map(str, path))
            raise TypeError(
                f"loss_fn wrote the model variable {name} ({type(var).__name__}); jaxdp carries "
                "only nnx.BatchStat variables from one micro-batch to the next and re-derives "
                "nnx.Rngs streams: declare running state as nnx.BatchStat"
            )
    return nnx.state(model, nnx.BatchStat)


def wire_dtype(dtype: Any, accum_dtype: Any) -> Any:
    """The dtype a state leaf travels in: the accumulator's where that is exact.

    Floats no wider than the accumulator, bools and integers travel as
    ``accum_dtype`` so they join the gradients' all-reduce (XLA reduces each
    dtype separately); integers are exact below 2**24 (float32) or 2**53
    (float64). Wider floats keep their dtype.
    """
    dtype, accum_dtype = jnp.dtype(dtype), jnp.dtype(accum_dtype)
    if jnp.issubdtype(dtype, jnp.inexact) and jnp.promote_types(dtype, accum_dtype) != accum_dtype:
        return dtype
    return accum_dtype


def device0(tree: Any, axis_name: str, accum_dtype: Any) -> Any:
    """Device 0's values and zeros elsewhere, in :func:`wire_dtype`: summed over
    the mesh, this broadcasts device 0's copy inside the gradients' psum."""
    first = jax.lax.axis_index(axis_name) == 0

    def mask(x):
        x = x.astype(wire_dtype(x.dtype, accum_dtype))
        return jnp.where(first, x, jnp.zeros_like(x))

    return jax.tree.map(mask, tree)


def from_wire(wire: Any, like: Any) -> Any:
    """The summed wire values back in the dtypes of ``like``."""
    return jax.tree.map(lambda w, x: w.astype(x.dtype), wire, like)

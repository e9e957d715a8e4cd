"""Data-parallel evaluation: per-row metrics of a held-out set, summed over the mesh.

Every device scores its block of each evaluation batch with the replicated
parameters; the sums meet in one ``psum`` per batch, so with several processes
each reads only its devices' rows and every process gets the whole set's means.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._checks import is_integer
from .._layout import batch_sizes, process_share
from .._mesh import DATA_AXIS, place
from ._prefetch import read_ahead
from ._source import Source, Transform

if TYPE_CHECKING:
    from jax.sharding import Mesh

MetricsFn = Callable[[Any, Any], Mapping[str, jax.Array]]
"""``metrics_fn(params, batch) -> {name: per-row values [rows]}`` (e.g. correct or not)."""


def evaluate(
    metrics_fn: MetricsFn,
    params: Any,
    source: Any,
    *,
    mesh: Mesh,
    batch_size: int,
    transform: Transform | None = None,
    workers: int = 2,
) -> dict[str, float]:
    """The mean over every row of ``source`` of each per-row metric of ``metrics_fn``.

    ``metrics_fn(params, batch)`` gets a device's block of ``batch_size`` rows
    (the source's fields, stacked as :class:`Loader` stacks them, each record
    through ``transform`` if given) and returns a mapping of per-row values, each
    of shape ``[batch_size]`` (bool, integer or float). The rows
    ``[0, len(source))`` are cut into evaluation batches of
    ``num_devices * batch_size``, device-major; the last batch is padded with
    row 0 at weight 0 (padding adds nothing). Each device sums its rows' values
    (integers exactly, floats in their dtype), one ``psum`` per batch adds the
    devices' (of every process), and the host adds the batches in float64 and
    divides by the number of rows. Each row counts once, whatever the device
    count. With several processes every process must call it (a collective);
    each reads only its devices' rows, ``workers`` threads ahead, and all get
    the same means. ``params`` (replicated on ``mesh``, or host values) are
    the same on every device. The compiled program is kept per
    ``(metrics_fn, mesh)``: pass the same function to evaluate again without
    compiling.

    Raises ``ValueError`` for a ``batch_size`` that is not a positive integer,
    a bad source (:class:`Loader`'s rules) and, at tracing, a metric whose shape
    is not ``[batch_size]``.
    """
    if not is_integer(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer (rows per device)")
    rows = Source(source, transform)
    sizes = batch_sizes(num_devices=mesh.devices.size, accum_steps=1, micro_batch_size=batch_size)
    mine = np.arange(sizes.global_batch_size)[process_share(mesh, sizes).rows]
    count = len(rows)

    def read(call: int) -> tuple[Any, np.ndarray]:
        index = call * sizes.global_batch_size + mine
        real = index < count
        return rows.read(np.where(real, index, 0)), real

    program = _program(metrics_fn, mesh)
    replicated = place(params, NamedSharding(mesh, P()))
    split = NamedSharding(mesh, P(DATA_AXIS))
    totals: dict[str, float] = {}
    calls = math.ceil(count / sizes.global_batch_size)
    closed = threading.Event()  # set on the way out: no read in flight is waited for
    try:
        for batch, real in read_ahead(read, 0, calls, workers=workers, closed=closed):
            sums = program(replicated, place(batch, split), place(real, split))
            for name, value in sums.items():
                total = np.asarray(value.addressable_data(0), np.float64)
                totals[name] = totals.get(name, 0.0) + float(total)
    finally:
        closed.set()
    return {name: total / count for name, total in totals.items()}


@functools.lru_cache(maxsize=16)  # one program per metric function and mesh, as jit's own cache
def _program(metrics_fn: MetricsFn, mesh: Mesh) -> Callable[..., dict[str, jax.Array]]:
    def per_device(params: Any, batch: Any, real: jax.Array) -> dict[str, jax.Array]:
        metrics = metrics_fn(params, batch)
        sums = {}
        for name, value in metrics.items():
            value = jnp.asarray(value)
            if value.shape != real.shape:
                raise ValueError(
                    f"metrics_fn's {name!r} has shape {value.shape}; a metric needs one value "
                    f"per row of the device's batch, shape {real.shape}"
                )
            sums[name] = jax.lax.psum(
                jnp.sum(jnp.where(real, value, jnp.zeros_like(value))), DATA_AXIS
            )
        return sums

    mapped = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), P(DATA_AXIS), P(DATA_AXIS)), out_specs=P()
    )
    return jax.jit(mapped)

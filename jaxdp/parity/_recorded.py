"""``compare_recorded``: a team's own torch script, as its ``torch_ref.Recorder`` recorded
it, against the JAX port, with ``compare_models``' comparison and locator."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import optax

from .._options import AccumulationPath, Strategy
from ._compare_models import report_of
from ._mapping import Mapping_
from ._optim import OptimizerSpec
from ._port import Loss, prepare, trace_jax_port
from ._runner import ParityReport


def compare_recorded(
    record: str | os.PathLike | Any,
    torch_model: Any,
    jax_model: Any,
    *,
    loss: Loss = "cross_entropy",
    jax_optimizer: optax.GradientTransformation | None = None,
    schedule: Any = None,
    mapping: Mapping_ = None,
    path: AccumulationPath = "fused",
    strategy: Strategy = "shard_map",
    step_options: Mapping[str, Any] | None = None,
    locate: bool | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    loss_reduction: Literal["mean", "weighted"] = "mean",
) -> ParityReport:
    """The JAX port trained as a team's own torch script trained, and compared after every
    optimizer step: :func:`compare_models` with the torch side recorded, not run.

    ``record``: a ``torch_ref.Record`` or the path a ``torch_ref.Recorder`` saved it to
    (the script run under its own launcher, or by ``jaxdp parity --torch-script``). It
    gives everything torch did: the layout (``num_devices`` ranks, ``accum_steps``
    micro-batches of ``micro_batch_size`` rows), the dtype, the starting weights, the
    micro-batches of every step in the order each rank trained on them, the optimizer and
    its parameter groups (an :class:`OptimizerSpec` with ``groups``), the learning rate
    of every group at every step, the weights and the loss after every step. jaxdp's step
    trains the port on ``num_devices`` devices from those weights on those batches.

    ``torch_model`` (a class, a factory or ``"MODULE:ATTR"``: the script's model, built
    here and given the recorded weights) decides the weight map with ``jax_model`` and
    ``mapping`` as in :func:`compare_models`, and lets the divergence locator run torch's
    forward and backward again; ``loss`` is the pair of losses, ``loss_reduction`` the
    script's (``"weighted"``: its loss returns ``(loss_sum, count)``). The port's
    optimizer: ``jax_optimizer``, or ``optax_like_torch`` of the recorded spec, each
    group holding the port's leaves of the torch parameters it names, with ``schedule``
    (an optax schedule of the first group's rate, the others' scaled by their base rate
    over its) or the recorded base rates. The locator replays torch's optimizer at the
    recorded rates. Tolerances: ``RTOL``/``ATOL`` of the recorded dtype unless given.
    """
    import torch_ref

    if isinstance(record, (str, os.PathLike)):
        record = torch_ref.load_record(record)
    if not isinstance(record, torch_ref.Record):
        raise TypeError(f"record={record!r} must be a torch_ref.Record or the path of one")
    spec = OptimizerSpec(**dataclasses.asdict(record.optimizer))
    x, y = (np.concatenate([batch[i] for batch in record.batches]) for i in range(2))
    port = prepare(
        torch_model,
        jax_model,
        (x, y),
        loss=loss,
        optimizer=spec,
        jax_optimizer=jax_optimizer,
        mapping=mapping,
        step_options=step_options,
        schedule=(record.lr_scheduler, schedule),
        initial=record.initial,
        permutation=functools.partial(recorded_order, record),
        num_devices=record.num_devices,
        accum_steps=record.accum_steps,
        micro_batch_size=record.micro_batch_size,
        steps=len(record.states),
        dtype=record.dtype,
        path=path,
        strategy=strategy,
        shuffle=True,
        seed=0,
        last_window="drop",
        torch_device="cpu",
        loss_reduction=loss_reduction,
        torch_side="recorded",
    )
    trace_jax_port(port)
    return report_of(port, record, rtol=rtol, atol=atol, locate=locate)


def recorded_order(record: Any, n: int, seed: int) -> np.ndarray:
    """The permutation under which a ``DistributedSampler`` over the record's batches, laid
    end to end (step, rank, micro-batch, row), gives each rank its recorded micro-batches
    in order: rank ``r`` takes ``perm[r::W]``, cut into micro-batches of ``B`` rows."""
    del seed  # one epoch, in the recorded order
    w, k, b = record.num_devices, record.accum_steps, record.micro_batch_size
    rows = np.arange(n).reshape(-1, w, k, b)  # dataset index by (step, rank, micro, row)
    if rows.size != sum(len(x) for x, _ in record.batches):
        raise ValueError(f"n={n} rows, and the record holds {rows.size}")
    per_rank = rows.transpose(1, 0, 2, 3).reshape(w, -1)  # rank r's rows, in its order
    return per_rank.T.reshape(-1)

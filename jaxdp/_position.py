"""Where a training run's data stream stands, and where it continues on another split.

Optimizer step ``s`` of an epoch trains on rows ``[s * G, (s + 1) * G)`` of
that epoch's sampler order (all ranks' strided shares together), whatever
``num_devices * accum_steps * micro_batch_size`` makes ``G =
global_batch_size``. So the same ``G`` continues the same data order on another
split, provided no accumulation window is open (the per-device accumulators of
an open window cannot be re-split); another ``G`` changes the data order and
the meaning of a step.
"""

from __future__ import annotations

from typing import NamedTuple

from ._checks import is_integer
from ._layout import BatchSizes


class SamplerPosition(NamedTuple):
    """Where the data stream stands: the NEXT data to train on.

    ``step_in_epoch`` indexes the rows of ``epoch_schedule(..., epoch=epoch).rows``
    (one global batch per optimizer step); ``micro_batch`` is the next of its
    ``accum_steps`` micro-batches on the ``multisteps`` path, 0 at an
    optimizer-step boundary (always 0 on the ``fused`` path).
    """

    epoch: int
    step_in_epoch: int
    micro_batch: int = 0


def resume_position(
    position: SamplerPosition, *, saved: BatchSizes, sizes: BatchSizes, steps_per_epoch: int
) -> SamplerPosition:
    """The position to continue from under the batch identity ``sizes``.

    Optimizer step ``s`` of an epoch trains on rows ``[s * G, (s + 1) * G)`` of
    the epoch's sampler order (all ranks' strided shares together), for any
    split of ``G = global_batch_size`` over devices and micro-batches; the same
    ``G`` therefore continues at the same step. Another ``G`` (forced) restarts
    at the step holding the first unseen row, so up to ``G - 1`` rows of the
    epoch are seen twice. Past the epoch's last step: the next epoch's start.
    """
    if not is_integer(steps_per_epoch) or steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch={steps_per_epoch!r} must be a positive integer")
    epoch, step, micro = position
    if saved.global_batch_size != sizes.global_batch_size:
        assert micro == 0, "checked by check_compatible"
        step = step * saved.global_batch_size // sizes.global_batch_size
    if step >= steps_per_epoch:
        return SamplerPosition(epoch + 1, 0, 0)
    return SamplerPosition(epoch, step, micro)

"""What each ZeRO stage splits, as data: one :class:`StageLayout` per stage, read by the
step (:mod:`._options`, :mod:`._shards`, :mod:`._pipeline`, :mod:`._step`) and by
``jaxdp plan`` (:mod:`jaxdp.plan`) alike, so that the two cannot drift.

The stage's number is compared nowhere else: code asks the layout's fields ("is the
optimizer state split?", "does the window hold blocks?", "do the parameters rest
split?"), and messages name the number the user gave.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

SplitRule = Literal["first", "last_but_first"]
"""Which dimension of a leaf a stage splits it along (:func:`jaxdp._shards.split_dim`):
``"first"``, the first that the devices divide; ``"last_but_first"``, the last such
other than the first (a 1-D leaf its only one), never a stack's layer axis."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageLayout:
    """What one ZeRO stage splits over the data axis (a shard group's devices under
    HSDP), each field one question the step and the planner ask.

    Attributes:
      zero_stage: the stage's number, ``Parallel.zero_stage`` (for messages).
      state_split: the optimizer state (and the master weights) is split: each device
        updates its block of every split leaf with its block of the state, the window's
        sums are reduce-scattered into blocks and the updated blocks all-gathered
        (stages 1 to 3). False: every device holds and updates everything (stage 0, DDP).
      window_split: the window's gradient sums are held as blocks: each micro-batch's
        gradients are reduce-scattered as they come, and the window's end reduces no
        split leaf again (stages 2 and 3).
      params_split: the parameters rest split, are gathered for each forward and stay
        split after the update, nothing gathered (stage 3, FSDP).
      split_rule: the dimension a split leaf is split along (:data:`SplitRule`):
        ``"first"`` at stages 1 and 2, ``"last_but_first"`` at stage 3, whose layer
        loop gathers a stack one layer at a time along its first dimension (stage 0
        splits nothing: its rule is never read).
      pads: a leaf none of whose rule's dimensions divides is split all the same, along
        its largest such dimension padded with zeros at its end to a multiple of the
        devices (FSDP2's rule; stage 3), so that only scalars stay whole. False: such a
        leaf is kept whole (replicated; stages 0 to 2).
    """

    zero_stage: int
    state_split: bool
    window_split: bool
    params_split: bool
    split_rule: SplitRule
    pads: bool = False


STAGE_LAYOUTS: tuple[StageLayout, ...] = (
    StageLayout(
        zero_stage=0, state_split=False, window_split=False, params_split=False, split_rule="first"
    ),
    StageLayout(
        zero_stage=1, state_split=True, window_split=False, params_split=False, split_rule="first"
    ),
    StageLayout(
        zero_stage=2, state_split=True, window_split=True, params_split=False, split_rule="first"
    ),
    StageLayout(
        zero_stage=3,
        state_split=True,
        window_split=True,
        params_split=True,
        split_rule="last_but_first",
        pads=True,
    ),
)
"""The layouts of ZeRO stages 0 to 3, indexed by the stage (:func:`stage_layout`)."""


def stage_layout(zero_stage: int) -> StageLayout:
    """The :class:`StageLayout` of ``zero_stage`` (0 to 3, checked by its caller)."""
    return STAGE_LAYOUTS[zero_stage]

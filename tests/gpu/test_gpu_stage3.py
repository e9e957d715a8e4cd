"""ZeRO stage 3 and HSDP compiled by XLA:GPU for 8 and 2 x 8 H100s without a GPU: a scanned
GPT-2-small-sized model (:class:`jaxdp.models.ScannedTransformer`: 12 blocks of width 768
looped by ``jaxdp.scan_layers``, vocabulary 50304, 1024 positions, bf16 compute over
float32 parameters, AdamW, 8 sequences per micro-batch and device).

Issue 42's properties, read from the scheduled program:
- the next layer's gather is in flight while the current one computes, in the forward and
  the backward, and each layer's reduce-scatter runs under the following backward work: at
  least 80% of the all-gather bytes and of the reduce-scatter bytes with a matrix product
  scheduled between start and done, leaving out what has nothing to hide under (each
  micro-batch's first gathers, the token embedding's and the first block's, and its last
  reduce-scatters, the token embedding's and the last block's);
- at the default remat (``"dots"``) the backward's layer loop runs no forward matrix
  product again: its matrix FLOPs are twice the forward loop's (the two products of each
  forward one's backward; full remat adds the forward's own, three times);
- each device's peak within 1.25x of ``jaxdp plan``'s figure at the default remat (the
  other choices' peaks against the plan are BENCHMARKS.md's, section 9, and the closed
  form of each is tests/core/test_stage3.py's).
"""

from __future__ import annotations

import jax
import pytest

from benchmarks.harness.gpu_programs import (
    MICRO_BATCH_SIZE,
    _nbytes,
    stage_3_first_and_last,
    stage_3_loss,
    stage_3_model,
    stage_3_plan_bytes,
    stage_3_step,
)
from jaxdp.plan import compiled_memory
from jaxdp.testing import Buckets, assert_collectives, instructions

HIDDEN = 0.8  # the share the acceptance asks for

_PROGRAMS: dict[tuple, tuple] = {}


def program(topology: str, k: int, shards: int | None = None, when: str = "per_layer"):
    """``(compiled, abstract state)`` of the cell (``when``: HSDP's
    ``Parallel.replica_all_reduce``), compiled once per run, as ``bin/jaxdp bench --only
    gpu_programs`` compiles it (its ``stage_3_step``)."""
    key = (topology, k, shards, when)
    if key not in _PROGRAMS:
        with jax.enable_x64(False):
            step, state, batch = stage_3_step(topology, shards, k, replica_all_reduce=when)
            _PROGRAMS[key] = (step.compile(state, batch), state)
    return _PROGRAMS[key]


# Stage 3 on one node at K = 1, HSDP (shard groups of 8) on two at K = 4: each layout, each
# K. HSDP's all-reduce across the replica groups per layer (the default; the test below
# holds what it hides on the same program). BENCHMARKS.md, section 9 reads both layouts at
# both K and HSDP's all-reduce after the backward (`bin/jaxdp bench --only gpu_programs`).
CELLS = [("1x1x8", 1, None, "per_layer"), ("1x2x8", 4, 8, "per_layer")]
ACROSS_HIDDEN = 0.9  # HSDP's cross-host bytes: the share issue 48 asks for


@pytest.mark.parametrize(("topology", "k", "shards", "when"), CELLS)
def test_gathers_and_reduce_scatters_hide_under_the_layers(topology, k, shards, when):
    compiled, state = program(topology, k, shards, when)
    # Per micro-batch, what has nothing to hide under: the token embedding's gather and the
    # first block's, and their reduce-scatters last; left out by their sizes.
    first = stage_3_first_and_last(state)
    assert_collectives(
        compiled,
        all_gather=Buckets(None, hidden=HIDDEN, exposed=lambda c: c.bytes in first),
        reduce_scatter=Buckets(None, hidden=HIDDEN, exposed=lambda c: c.bytes in first),
        all_reduce=None,
    )


def test_the_backward_runs_no_forward_matrix_product_again_at_the_default_remat():
    compiled, _ = program("1x1x8", 1)
    per_loop: dict[tuple, int] = {}
    for i in instructions(compiled):
        if i.flops and len(i.context) == 1 and i.context[0].startswith("while"):
            per_loop[i.context] = per_loop.get(i.context, 0) + i.flops
    forward, backward = sorted(per_loop.values())  # the layer loops, one iteration each
    assert len(per_loop) == 2 and backward == 2 * forward, per_loop


def test_the_peak_is_within_a_quarter_of_the_plans_figure_at_the_default_remat():
    compiled, state = program("1x1x8", 1)
    peak = compiled_memory(compiled).peak
    plan = stage_3_plan_bytes(
        stage_3_model, stage_3_loss, state, num_devices=8, micro=MICRO_BATCH_SIZE, k=1, remat="dots"
    )
    assert plan / 1.25 <= peak <= 1.25 * plan, (peak, plan, peak / plan)


def test_hsdp_sends_each_layers_blocks_across_the_hosts_under_the_backward():
    """HSDP, the stack declared (the model's metadata), ``replica_all_reduce="per_layer"``
    (the default): each layer's reduce-scattered block goes across the replica groups,
    the only traffic between hosts, inside the backward's layer loop, under the next
    layer's matrix products (not once after the backward: 16% hidden); the lowest
    layer's, the backward's last, after it. Left out: the two embedding-sized blocks'
    (the token embedding's, complete at the backward's end, and the untied head's, which
    XLA schedules after the loop with its reduce-scatter). Measured: 90.8% of the rest,
    also at K=1 and on 16 x 8 and 128 x 8 H100s (BENCHMARKS.md, section 9)."""
    compiled, state = program("1x2x8", 4, 8)
    embedding = _nbytes(state.params["tok_emb"]) // 8  # a block of the token embedding
    assert_collectives(
        compiled,
        all_reduce=Buckets(None, hidden=ACROSS_HIDDEN, exposed=lambda c: c.bytes >= embedding),
        all_gather=None,
        reduce_scatter=None,
    )

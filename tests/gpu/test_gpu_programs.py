"""jaxdp's step for a GPT-2-small-sized model, compiled by XLA:GPU for one node of 8 H100s
(``1x1x8``) and two nodes of 8 (``1x2x8``) without a GPU (:func:`jaxdp.testing.gpu_mesh`),
read from its scheduled program and its memory analysis.

The property of issue 41 (DDP's overlap): the window's gradient bytes travel once per
optimizer step, on its last micro-batch only, in buckets XLA schedules under the rest of
that micro-batch's backward (``Parallel(bucket_cap_mb=25)``, XLA's combine threshold in
the step's own compiler options): at least 90% of them with a matrix product between the
collective's start and done, leaving out the tied token embedding, whose gradient the
first layer's backward completes with nothing left to hide under. At ZeRO stage 2 every
micro-batch's reduce-scatter hides under its own backward.

The model: GPT-2 small (124M parameters: 12 blocks of width 768, vocabulary 50304, 1024
positions, the head tied to the token embedding), float32 parameters, bfloat16 compute,
AdamW, 8 sequences of 1024 tokens per micro-batch and device, as
``benchmarks/harness/gpu.py`` trains it on one GPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxdp
from benchmarks.harness import gpu
from jaxdp.plan import compiled_memory
from jaxdp.testing import Buckets, assert_collectives, collectives, format_report, gpu_mesh

MODEL = gpu.GPT2_SMALL
MICRO_BATCH_SIZE = 8
# (topology, zero_stage, path, accum_steps), at K = 4, whose program holds K = 1's (the last
# micro-batch after the loop) and the loop over the first K - 1 micro-batches: the
# all-reduce's buckets after the loop (stage 0, fused) and in the multisteps branch, on one
# node and on two; the reduce-scatter's in the loop and after it (stage 2, which
# reduce-scatters every micro-batch; stage 1 reduces as stage 0 does, once after the loop).
# A GPT-2 compile costs 30 to 55 CPU s here, so the suite compiles these 3;
# `bin/jaxdp bench --only gpu_programs` reads every (topology, stage, path, K in 1 and 4)
# into BENCHMARKS.md, section 9.
CELLS = [
    ("1x1x8", 0, "fused", 4),
    ("1x2x8", 0, "multisteps", 4),
    ("1x1x8", 2, "fused", 4),
]
HIDDEN = 0.9  # the share of the gradient bytes the acceptance asks to hide under GEMMs

_PROGRAMS: dict[tuple, tuple] = {}


def program(topology: str, stage: int, path: str, k: int):
    """``(compiled, abstract state, batch)`` of the cell, compiled once per run."""
    key = (topology, stage, path, k)
    if key not in _PROGRAMS:
        # As a user's script runs: jax's default 32-bit types (tests/conftest.py turns
        # float64 on for the CPU tests).
        with jax.enable_x64(False):
            mesh = gpu_mesh(topology)
            step = jaxdp.make_train_step(
                gpu.nnx_loss,
                optax.adamw(3e-4, weight_decay=0.1),
                mesh=mesh,
                accum_steps=k,
                path=path,
                parallel=jaxdp.Parallel(zero_stage=stage),
            )
            model = nnx.eval_shape(lambda: gpu.nnx_model(MODEL, dtype=jnp.bfloat16))
            state = step.abstract_state(model)
            rows = mesh.size * (k if path == "fused" else 1) * MICRO_BATCH_SIZE
            batch = (jax.ShapeDtypeStruct((rows, MODEL.block_size), jnp.int32),) * 2
            _PROGRAMS[key] = (step.compile(state, batch), state, batch)
    return _PROGRAMS[key]


def nbytes(tree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def per_device(tree) -> int:
    """Bytes one device holds of ``tree``'s abstract leaves, by their shardings."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


CELL_IDS = [f"{t}-stage{s}-{p}-K{k}" for t, s, p, k in CELLS]


@pytest.mark.parametrize(("topology", "stage", "path", "k"), CELLS, ids=CELL_IDS)
def test_gradients_travel_in_buckets_under_the_backward(topology, stage, path, k):
    compiled, state, _ = program(topology, stage, path, k)
    gradients = nbytes(state.params)  # float32: the accumulator's dtype too
    tied = nbytes(state.params["wte"])  # complete only at the backward's end
    assert 0.3 < tied / gradients < 0.32  # GPT-2 small's vocabulary: 31% of its bytes
    times = k if stage == 2 else 1  # stage 2 reduce-scatters every micro-batch
    # Its reduction is larger than any bucket, so it travels alone: left out by its size.
    buckets = Buckets(gradients * times, hidden=HIDDEN, exposed=lambda c: c.bytes >= tied)
    if stage == 0:
        expected = dict(all_reduce=buckets, reduce_scatter=0, all_gather=0)
    else:  # the small psum (norm, loss) and the updated parameters' one all-gather
        expected = dict(all_reduce=None, reduce_scatter=buckets, all_gather=1)
    if path == "fused":
        assert_collectives(compiled, **expected)
    else:
        assert_collectives(compiled, **expected, branch="applied")
        # A call inside the window sends nothing: DDP's no_sync().
        assert_collectives(compiled, branch="skipped")
    gradient_kind = "all-reduce" if stage == 0 else "reduce-scatter"
    grads = [c for c in collectives(compiled) if c.kind == gradient_kind and c.bytes > 2**16]
    assert len(grads) > 10  # buckets (at most 25 MiB each but a larger leaf), not one
    if stage < 2:  # the first K-1 micro-batches' loop sends no gradient byte
        assert not [c for c in grads if c.in_loop], [c.context for c in grads]


@pytest.mark.parametrize(("topology", "stage", "path", "k"), CELLS, ids=CELL_IDS)
def test_the_arguments_are_the_state_as_the_step_lays_it_out(topology, stage, path, k):
    """XLA's per-device arguments are exactly the abstract state's blocks, the batch's
    rows and the micro-batch weights: the optimizer state split 8 ways at stages 1 and 2
    (16 ways on two nodes), whole at stage 0."""
    compiled, state, batch = program(topology, stage, path, k)
    memory = compiled_memory(compiled)
    mesh_size = int(topology.split("x")[1]) * 8
    rows = sum(math.prod(x.shape) * 4 for x in batch) // mesh_size
    weights = 4 * (k if path == "fused" else 1)
    assert memory.arguments == per_device(state) + rows + weights
    adam = nbytes(state.opt_state)
    split = per_device(state.opt_state)
    if stage == 0:
        assert split == adam
    else:  # every leaf of GPT-2 small divides by 8 and 16; the step counts are scalars
        assert split < adam / mesh_size + 64
    assert memory.peak is not None and memory.peak > memory.arguments


def test_the_bucket_cap_is_xlas_combine_threshold_in_the_steps_own_program():
    """``Parallel(bucket_cap_mb=...)`` reaches XLA:GPU as the step's own compiler options
    (nothing in ``XLA_FLAGS``): an MLP's 100 MB of gradients go out in three buckets at
    25 MiB (its 64 MiB kernel alone), in one at 128 MiB, and the reduce-scatter's
    threshold is a shard group's share of the cap."""
    with jax.enable_x64(False):
        mesh = gpu_mesh("1x1x8")
        model = nnx.eval_shape(
            lambda: jaxdp.models.MLP(1024, hidden=4096, num_classes=1000, rngs=nnx.Rngs(0))
        )
        batch = (
            jax.ShapeDtypeStruct((8 * 64, 1024), jnp.float32),
            jax.ShapeDtypeStruct((8 * 64,), jnp.int32),
        )
        buckets = {}
        for cap in (25, 128):
            step = jaxdp.make_train_step(
                jaxdp.models.model_loss("mlp"),
                optax.sgd(0.1),
                mesh=mesh,
                parallel=jaxdp.Parallel(bucket_cap_mb=cap),
            )
            assert step.options.compiler_options() == {
                "xla_gpu_all_reduce_combine_threshold_bytes": cap * 2**20,
                "xla_gpu_reduce_scatter_combine_threshold_bytes": cap * 2**20 // 8,
                "xla_gpu_experimental_parallel_collective_overlap_limit": 1,
            }
            compiled = step.compile(step.abstract_state(model), batch)
            buckets[cap] = sorted(c.bytes for c in collectives(compiled))
    assert len(buckets[25]) == 3 and max(buckets[25]) == 4096 * 4096 * 4
    assert len(buckets[128]) == 1 and buckets[128][0] == sum(buckets[25])


# A deep residual MLP stack (12 blocks, width 1024, hidden 4096, bf16 compute), scanned with
# jaxdp.scan_layers and declared a stack (Parallel.layers): each layer's gradients leave the
# (unrolled) loop's backward as the layer ends, one collective per layer. On 8 H100s: 0%
# hidden undeclared at stages 0, 1 and 2 (every byte after the loop), declared 91.7% at each
# (the first layer's gradients go after the last product).
MLP_LAYERS, MLP_WIDTH, MLP_HIDDEN = 12, 1024, 4096


def mlp_loss(params, batch):
    x, y = batch

    def block(layer, h):
        u = jax.nn.gelu(h.astype(jnp.bfloat16) @ layer["w1"].astype(jnp.bfloat16))
        return h + (u @ layer["w2"].astype(jnp.bfloat16)).astype(h.dtype)

    h = jaxdp.scan_layers(block, params["blocks"], x @ params["embed"])
    return jnp.mean((h @ params["head"] - y) ** 2)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_declared_scanned_stack_sends_each_layers_gradients_under_the_backward(stage):
    with jax.enable_x64(False):
        mesh = gpu_mesh("1x1x8")
        step = jaxdp.make_train_step(
            mlp_loss,
            optax.adamw(1e-3),
            mesh=mesh,
            parallel=jaxdp.Parallel(zero_stage=stage, layers=("blocks",)),
        )
        s = jax.ShapeDtypeStruct
        w, h, n = MLP_WIDTH, MLP_HIDDEN, MLP_LAYERS
        params = {
            "embed": s((256, w), jnp.float32),
            "blocks": {"w1": s((n, w, h), jnp.float32), "w2": s((n, h, w), jnp.float32)},
            "head": s((w, 16), jnp.float32),
        }
        state = step.abstract_state(params)
        rows = mesh.size * 4096
        batch = (s((rows, 256), jnp.float32), s((rows, 16), jnp.float32))
        compiled = step.compile(state, batch)
        if stage == 1:  # compiled with one bucket in flight, as a routed stack's program
            assert step._program(state) is step._programs[True]
    buckets = Buckets(nbytes(params), hidden=HIDDEN)
    if stage == 0:
        assert_collectives(compiled, all_reduce=buckets, reduce_scatter=0, all_gather=0)
    else:
        assert_collectives(compiled, all_reduce=None, reduce_scatter=buckets, all_gather=1)
    kind = "all-reduce" if stage == 0 else "reduce-scatter"
    grads = [c for c in collectives(compiled) if c.kind == kind and c.bytes > 2**16]
    # Layer by layer, each layer's leaves in one collective (jaxdp._layers.Route.packed),
    # which XLA combines with no other layer's.
    layer = nbytes(params["blocks"]) // n
    assert sum(1 for c in grads if c.bytes == layer) == n, format_report(grads)


@pytest.mark.parametrize("cap", [0.5, 1e-9])
def test_every_gradient_byte_is_seen_also_in_collective_fusions(cap):
    """A bucket smaller than a leaf (``bucket_cap_mb=0.5`` with 1 MiB kernels; ``1e-9``:
    every leaf alone): XLA:GPU runs such a leaf's all-reduce in a collective fusion
    (``fusion-start`` calling a computation that holds the all-reduce). The inspector
    counts it with the others: every gradient byte, in flight between start and done."""
    with jax.enable_x64(False):
        mesh = gpu_mesh("1x1x8")
        model = nnx.eval_shape(
            lambda: jaxdp.models.MLP(512, hidden=512, num_classes=512, rngs=nnx.Rngs(0))
        )
        batch = (
            jax.ShapeDtypeStruct((8 * 4, 512), jnp.float32),
            jax.ShapeDtypeStruct((8 * 4,), jnp.int32),
        )
        step = jaxdp.make_train_step(
            jaxdp.models.model_loss("mlp"),
            optax.sgd(0.1),
            mesh=mesh,
            parallel=jaxdp.Parallel(bucket_cap_mb=cap),
        )
        state = step.abstract_state(model)
        compiled = step.compile(state, batch)
    assert "fusion-start" in compiled.as_text()  # the form this test is about
    gradients = nbytes(state.params)  # 3 kernels of 1 MiB, 3 biases
    assert_collectives(compiled, all_reduce=Buckets(gradients))  # with the loss and weight
    found = collectives(compiled)
    assert all(c.asynchronous for c in found)
    assert sum(c.bytes for c in found if c.bytes >= 2**20) == 3 * 2**20


def test_a_target_file_xla_cannot_read_is_named_not_taken_for_a_missing_plugin(tmp_path):
    bad = tmp_path / "mine.txtpb"
    bad.write_text("gpu_device_info {\n  threads_per_block_limit: oops\n")
    with pytest.raises(ValueError, match=r"target='.*mine.txtpb': XLA:GPU cannot read this file"):
        gpu_mesh("1x1x8", target=str(bad))

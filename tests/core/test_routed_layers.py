"""``Parallel(layers=...)`` at ZeRO stages 0 to 2: a stack's gradients reduced layer by
layer in ``jaxdp.scan_layers``' backward (the plain spelling GPUs take), the updates
of one device on the big batch, the stack refused outside the loop, and XLA:CPU's
program unchanged."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdp
from jaxdp._shards import stacked_leaves
from jaxdp.testing import assert_trees_close, collectives, format_report, plain_spelling

IN, WIDTH, OUT = 6, 8, 3
GLOBAL_BATCH, STEPS = 24, 2


def stacked_params(layers):
    """An embedding, ``layers`` residual blocks stacked on a leading axis, a head."""
    rng = np.random.default_rng(0)

    def normal(*shape, scale):
        return rng.normal(size=shape, scale=scale).astype(np.float64)

    return {
        "embed": {"w": normal(IN, WIDTH, scale=0.4)},
        "blocks": {
            "w": normal(layers, WIDTH, WIDTH, scale=0.3),
            "b": normal(layers, WIDTH, scale=0.1),
        },
        "head": {"w": normal(WIDTH, OUT, scale=0.3), "b": normal(OUT, scale=0.1)},
    }


def block(layer, h):
    return h + jnp.tanh(h @ layer["w"] + layer["b"])


def loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["embed"]["w"])
    h = jaxdp.scan_layers(block, params["blocks"], h)
    return jnp.mean((h @ params["head"]["w"] + params["head"]["b"] - y) ** 2)


def batch():
    rng = np.random.default_rng(1)
    return rng.normal(size=(GLOBAL_BATCH, IN)), rng.normal(size=(GLOBAL_BATCH, OUT))


def optimizer():
    # The clip acts (max_norm below the gradients' norms): it needs the whole norm.
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=1e-2))


def train(num_devices, accum_steps, path, stage, layers, n_layers, **parallel):
    step = jaxdp.make_train_step(
        loss,
        optimizer(),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        path=path,
        parallel=jaxdp.Parallel(zero_stage=stage, layers=layers, **parallel),
    )
    state, (x, y) = step.init(stacked_params(n_layers)), batch()
    calls = 1 if path == "fused" else accum_steps
    rows = GLOBAL_BATCH // calls
    for _ in range(STEPS):
        for c in range(calls):
            state, _ = step(state, (x[c * rows : (c + 1) * rows], y[c * rows : (c + 1) * rows]))
    return step, jax.device_get(step.model(state)), state


# (stage, path, accum_steps, layers of the stack): every stage, both paths, stacks of 1 to
# 3 layers, K 1 and 3 (stage 1 splits the blocks' width 8 over 4 devices).
CELLS = [(0, "multisteps", 3, 3), (0, "fused", 1, 1), (1, "fused", 3, 2)]
CELLS += [(2, "multisteps", 3, 1)]


@pytest.mark.parametrize(("stage", "path", "accum_steps", "n_layers"), CELLS)
def test_routed_stack_equals_one_device_on_the_big_batch(stage, path, accum_steps, n_layers):
    with plain_spelling():
        step, params, _ = train(4, accum_steps, path, stage, ("blocks",), n_layers)
    assert step.options.plan(params).stacked == [True, True, False, False, False]
    _, reference, _ = train(1, 1, "fused", 0, None, n_layers)
    assert_trees_close(params, reference)


# (path, accum_steps, Parallel.replica_all_reduce, layers of the stack): the loop sends each
# layer's blocks one layer later, the lowest's after it; the top layer runs outside it.
HSDP_CELLS = [("fused", 3, "per_layer", 3), ("multisteps", 3, "per_layer", 3)]
HSDP_CELLS += [("multisteps", 3, "after_backward", 3), ("fused", 1, "per_layer", 1)]
HSDP_CELLS += [("multisteps", 3, "per_layer", 2)]


@pytest.mark.parametrize(("path", "accum_steps", "when", "n_layers"), HSDP_CELLS)
def test_hsdp_sends_each_layers_blocks_across_the_replicas_in_the_backward(
    path, accum_steps, when, n_layers
):
    """HSDP with a stack declared: each layer's reduce-scattered block, plus the window's
    sums of it, is all-reduced over the replica groups inside the backward's layer loop
    (``replica_all_reduce="after_backward"``: once after it, outside every loop), and the
    updates are one device's on the big batch either way."""
    with plain_spelling():
        step, params, state = train(
            4, accum_steps, path, 3, ("blocks",), n_layers, shards=2, replica_all_reduce=when
        )
        calls = 1 if path == "fused" else accum_steps
        x, y = batch()
        compiled = step.compile(state, (x[: GLOBAL_BATCH // calls], y[: GLOBAL_BATCH // calls]))
    _, reference, _ = train(1, 1, "fused", 0, None, n_layers)
    assert_trees_close(params, reference)
    across = [c for c in collectives(compiled) if c.kind == "all-reduce" and c.devices == 2]
    in_loop = [c for c in across if any(p.startswith("while") for p in c.context)]
    # The loop runs over all layers but the top: over one, XLA drops it.
    looped = when == "per_layer" and n_layers > 2
    assert across and bool(in_loop) is looped, format_report(collectives(compiled))


@pytest.mark.parametrize("plain", [False, True])
def test_xla_cpu_keeps_its_program_with_a_stack_declared(plain):
    """On XLA:CPU a declared stack changes nothing (nothing would overlap there)."""
    programs = []
    for layers in (None, ("blocks",)):
        with plain_spelling() if plain else contextlib.nullcontext():
            step = jaxdp.make_train_step(
                loss,
                optimizer(),
                mesh=jaxdp.data_mesh(2),
                accum_steps=2,
                parallel=jaxdp.Parallel(layers=layers),
            )
            state = step.init(stacked_params(3))
            programs.append(instructions(step.compile(state, batch()).as_text()))
    # The plain spelling (GPUs') reduces the stack in its loop's backward: another program.
    assert (programs[0] == programs[1]) is not plain


def instructions(text):
    """The program's instructions, without the source locations of the Python that
    traced them (which differ between the two traces)."""
    lines = [line for line in text.splitlines() if " = " in line]
    return [re.sub(r", (metadata|origin)=\{[^}]*\}", "", line) for line in lines]


def test_a_stack_used_outside_scan_layers_is_refused_by_name():
    def outside(params, batch):
        x, y = batch
        h = x @ params["embed"]["w"] @ params["blocks"]["w"][0]  # not through the loop
        return jnp.mean((h @ params["head"]["w"] - y) ** 2)

    with plain_spelling():
        step = jaxdp.make_train_step(
            outside,
            optax.sgd(0.1),
            mesh=jaxdp.data_mesh(2),
            parallel=jaxdp.Parallel(layers=("blocks",)),
        )
        state = step.init(stacked_params(3))
        with pytest.raises(TypeError, match=r"params\['blocks'\]\['w'\] is a stack of layers"):
            step(state, batch())


def test_layers_must_be_names_or_a_callable():
    with pytest.raises(ValueError, match="layers=5 must be None"):
        jaxdp.Parallel(layers=5)
    assert jaxdp.Parallel(layers="blocks").layers == ("blocks",)


def test_the_stack_is_read_from_the_models_sharding_metadata():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.ones((4, 4)), out_sharding=(None, None), eager_sharding=False)
            self.b = nnx.Param(jnp.ones((4,)))  # no metadata: not said to be a stack

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def blocks(rngs):
        return Block(rngs)

    state = nnx.state(blocks(nnx.Rngs(0)), nnx.Param)
    assert stacked_leaves(state) == [False, True]  # b, w in key order
    assert stacked_leaves(state, lambda path, leaf: path.startswith("['b']")) == [True, False]


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_a_declared_stack_at_stage_3_is_handed_over_and_loss_fn_traced_as_at_stage_0(path):
    """Declared, a stage-3 stack reaches scan_layers as its blocks: loss_fn is traced as
    often as at stage 0 (nothing finds the stacks by tracing it again), and the updates
    are stage 0's. Undeclared, it is traced as often too (gathered whole, with a warning)."""
    traces = {}

    def counted(stage, layers):
        def counting(params, batch):
            traces[stage, layers] = traces.get((stage, layers), 0) + 1
            return loss(params, batch)

        step = jaxdp.make_train_step(
            counting,
            optimizer(),
            mesh=jaxdp.data_mesh(4),
            accum_steps=3,
            path=path,
            parallel=jaxdp.Parallel(zero_stage=stage, layers=layers),
        )
        state, (x, y) = step.init(stacked_params(3)), batch()
        calls = 1 if path == "fused" else 3
        for c in range(calls):
            rows = slice(c * GLOBAL_BATCH // calls, (c + 1) * GLOBAL_BATCH // calls)
            state, _ = step(state, (x[rows], y[rows]))
        return jax.device_get(step.model(state))

    declared = counted(3, ("blocks",))
    assert_trees_close(declared, counted(0, None))
    assert traces[3, ("blocks",)] == traces[0, None]
    with pytest.warns(UserWarning, match="no stack of layers is declared"):
        counted(3, None)
    assert traces[3, None] == traces[0, None]

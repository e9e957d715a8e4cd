"""ZeRO stage 3 (the parameters split at rest) and ``jaxdp.scan_layers``: the split layout
at rest, one gather per layer inside the layer loop (read from
the compiled program) and the memory XLA plans for the step. That every layout of stage 3,
scanned or not, trains as one device on the big batch is test_equivalence.py's grid, which
takes its models from here."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import train, unpadded

import jaxdp
from jaxdp.testing import TOLERANCES, assert_trees_close

# The modules' cached steps and runs (below, and test_hsdp.py's): one worker runs them all.
pytestmark = pytest.mark.xdist_group("stage3")

IN, WIDTH, OUT, LAYERS = 6, 8, 3, 3
GLOBAL_BATCH, STEPS = 24, 3  # 24 rows divide by every num_devices * accum_steps below


def optimizer():
    # max_norm below the model's gradient norms, so the clip acts and needs the whole norm.
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=1e-2))


def stacked_params(seed=0, layers=LAYERS, width=WIDTH):
    """An embedding, ``layers`` identical residual blocks stacked on a leading axis, a
    norm and a head whose leaves no device count here divides (at stage 3 padded: 8 x 3
    to 8 x 4, 3 to 4)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale):
        return rng.normal(size=shape, scale=scale).astype(np.float64)

    return {
        "embed": {"w": normal(IN, width, scale=0.4), "b": normal(width, scale=0.1)},
        "blocks": {
            "w": normal(layers, width, width, scale=0.3),
            "b": normal(layers, width, scale=0.1),
        },
        "norm": {"scale": 1 + normal(width, scale=0.1)},
        "head": {"w": normal(width, OUT, scale=0.3), "b": normal(OUT, scale=0.1)},
    }


def block(layer, h):
    return h + jnp.tanh(h @ layer["w"] + layer["b"])


def normed(scale, h):
    centred = h - h.mean(-1, keepdims=True)
    return centred / jnp.sqrt((centred**2).mean(-1, keepdims=True) + 1e-6) * scale


def unrolled(fn, layers, carry):
    """The layer loop written out in Python: what a model without scan_layers does."""
    for i in range(jax.tree.leaves(layers)[0].shape[0]):
        carry = fn(jax.tree.map(lambda x, i=i: x[i], layers), carry)
    return carry


def apply(params, x, loop=jaxdp.scan_layers):
    h = jnp.tanh(x @ params["embed"]["w"] + params["embed"]["b"])
    h = loop(block, params["blocks"], h)
    return normed(params["norm"]["scale"], h) @ params["head"]["w"] + params["head"]["b"]


def loss(params, batch):
    x, y = batch
    return jnp.mean((apply(params, x) - y) ** 2)


def unscanned_loss(params, batch):
    x, y = batch
    return jnp.mean((apply(params, x, loop=unrolled) - y) ** 2)


def data(rows=GLOBAL_BATCH * STEPS, width_in=IN, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, width_in)), rng.normal(size=(rows, OUT))


def batches():
    x, y = data()
    return [(x[i::STEPS], y[i::STEPS]) for i in range(STEPS)]


STACK = ("blocks",)  # Parallel.layers: the stack of stacked_params (and of Net)


def make(stage, num_devices, accum_steps, path="fused", loss_fn=loss, remat="dots", layers=STACK):
    """``layers``: the stack declared at stage 3 (None: none, as a model without a loop)."""
    more = {"remat": remat, "layers": layers} if stage == 3 else {}
    return jaxdp.make_train_step(
        loss_fn,
        optimizer(),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        path=path,
        parallel=jaxdp.Parallel(zero_stage=stage, **more),
    )


# One step per layout, its program compiled once for the tests that read it (a test of a
# warning given while tracing builds its own step: a shared one is traced only once).
shared_step = functools.cache(make)


@functools.cache  # a layout's run, trained once for the tests that read it
def trained(stage, num_devices, accum_steps, path="fused", loss_fn=loss, model=stacked_params):
    return train(shared_step(stage, num_devices, accum_steps, path, loss_fn), model(), batches())


def reference(loss_fn=loss, model=stacked_params):
    """Stage 0 on one device, one micro-batch: the big batch, which every stage, layout and
    path trains as (test_equivalence.py)."""
    return trained(0, 1, 1, loss_fn=loss_fn, model=model)


def assert_same_training(run, expected_run):
    (state, history), (expected, expected_history) = run, expected_run
    assert int(state.step) == int(expected.step) == STEPS
    # Stage 3 holds the head padded (zeros, asserted): compared in the model's shapes.
    assert_trees_close(
        unpadded(state.params, expected.params),
        expected.params,
        rtol=TOLERANCES["float64"].rtol,
        atol=TOLERANCES["float64"].atol,
    )
    assert_trees_close(
        unpadded(state.opt_state, expected.opt_state),
        expected.opt_state,
        rtol=TOLERANCES["float64"].rtol,
        atol=TOLERANCES["float64"].atol,
    )
    # The calls that end a window: every fused call, the multisteps path's K-th.
    losses = [[m["loss"] for m in h if m.get("emitted", True)] for h in (history, expected_history)]
    np.testing.assert_allclose(losses[0], losses[1], rtol=TOLERANCES["float64"].rtol)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, h):
        return h + jnp.tanh(self.linear(h))


class Net(nnx.Module):
    """The stacked model as NNX modules: the blocks made with ``nnx.vmap``."""

    def __init__(self, rngs):
        self.embed = nnx.Linear(IN, WIDTH, param_dtype=jnp.float64, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return Block(rngs)

        self.blocks = blocks(rngs)
        self.norm = nnx.LayerNorm(WIDTH, param_dtype=jnp.float64, rngs=rngs)
        self.head = nnx.Linear(WIDTH, OUT, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.embed(x))
        h = jaxdp.scan_layers(lambda layer, h: layer(h), self.blocks, h)
        return self.head(self.norm(h))


def nnx_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def nnx_net():
    """A Net, its parameters drawn with numpy: nnx's initializers run eagerly, each random
    op compiled on first use (about 3 CPU s of the test); the modules are nnx's own."""
    model = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))
    rng = np.random.default_rng(3)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: rng.normal(size=x.shape, scale=0.3), params))
    return model


def test_an_nnx_vmap_stack_rests_split_along_its_width():
    # That it trains as one device on the big batch: test_equivalence.py's grid.
    state = make(3, 4, 2, loss_fn=nnx_loss).init(nnx_net())
    (kernel,) = jax.tree.leaves(state.params["blocks"]["linear"]["kernel"])
    assert kernel.addressable_shards[0].data.shape == (LAYERS, WIDTH, WIDTH // 4)


# Per device on 4 devices: every leaf's block (never along the blocks' layer axis), the
# head's padded (4 divides neither 8 x 3's last dimension nor 3: padded to 4, 1 each).
BLOCKS_ON_4 = {
    "embed": {"w": (IN, WIDTH // 4), "b": (WIDTH // 4,)},
    "blocks": {"w": (LAYERS, WIDTH, WIDTH // 4), "b": (LAYERS, WIDTH // 4)},
    "norm": {"scale": (WIDTH // 4,)},
    "head": {"w": (WIDTH, 1), "b": (1,)},
}


def per_device_shapes(tree):
    return jax.tree.map(lambda x: x.addressable_shards[0].data.shape, tree)


def test_parameters_gradients_and_moments_rest_split():
    step = shared_step(3, 4, 2)
    trained_state = trained(3, 4, 2)[0]
    for when, state in (("after init", step.init(stacked_params())), ("trained", trained_state)):
        adam = state.opt_state[1][0]
        for tree in (state.params, adam.mu, adam.nu):
            assert per_device_shapes(tree) == BLOCKS_ON_4, when
            # The padding is zeros and stays zeros.
            head = tree["head"]
            assert head["w"].shape == (WIDTH, 4) and head["b"].shape == (4,), when
            assert (
                not np.asarray(head["w"])[:, OUT:].any() and not np.asarray(head["b"])[OUT:].any()
            )
        assert state.params["blocks"]["w"].sharding.spec == jax.sharding.PartitionSpec(
            None, None, "data"
        )
        assert state.params["head"]["w"].sharding.spec == jax.sharding.PartitionSpec(None, "data")
        # blocks b, w, embed b, w, head b, w, norm scale: the head's two padded
        assert state.logical.params == (None,) * 4 + ((OUT,), (WIDTH, OUT), None)
    # The model comes back in its own shapes: global arrays, the head sliced.
    model = step.model(trained_state)
    assert jax.tree.map(np.shape, model) == jax.tree.map(np.shape, stacked_params())
    # The multisteps window holds the gradient blocks, as at stage 2, the head's padded
    # (its shapes do not depend on K; a trained state's window is emptied, not resized).
    window = trained(3, 4, 1, "multisteps")[0].window
    assert per_device_shapes(window.grads) == BLOCKS_ON_4


def test_padded_leaves_travel_in_no_all_reduce():
    """Every leaf but the scalars is split (the head padded): the step's all-reduces carry
    scalars only (the loss, weight and squares' sums), no parameter's gradient."""
    step = shared_step(3, 4, 2)
    compiled = step.compile(step.init(stacked_params()), batches()[0])
    found = jaxdp.testing.collectives(compiled)
    reduces = [c for c in found if c.kind == "all-reduce"]
    assert reduces and all(s.endswith("[]") for c in reduces for s in c.shapes), (
        jaxdp.testing.format_report(found)
    )


def test_the_model_comes_back_unpadded_and_equal_to_one_device():
    step, (state, _) = shared_step(3, 4, 2), trained(3, 4, 2)
    model = step.model(state)
    assert_trees_close(model, reference()[0].params)
    # The head laid out along another dimension 4 divides (8 x 3: the first), its bias
    # (3) replicated.
    assert model["head"]["w"].sharding.spec == jax.sharding.PartitionSpec("data")
    assert model["head"]["b"].sharding.is_fully_replicated


def test_hsdp_pads_to_the_shard_count():
    """8 devices in shard groups of 4 and 2: the head (8 x 3) pads to 8 x 4 either way, its
    block a quarter or a half of it; plain stage 3 on 8 pads to 8 x 8."""
    for shards, rest, block in ((4, (8, 4), (8, 1)), (2, (8, 4), (8, 2)), (None, (8, 8), (8, 1))):
        step = jaxdp.make_train_step(
            loss,
            optimizer(),
            mesh=jaxdp.data_mesh(8),
            parallel=jaxdp.Parallel(zero_stage=3, shards=shards, layers=STACK),
        )
        head = step.init(stacked_params()).params["head"]["w"]
        assert head.shape == rest and head.addressable_shards[0].data.shape == block, shards


def loops(collective):
    """The trip counts of the loops around ``collective``, outermost first."""
    return [int(c.rsplit("x", 1)[1]) for c in collective.context if c.startswith("while")]


def test_one_gather_per_layer_inside_the_loop_and_none_after_the_update():
    """K=2 micro-batches of L=3 layers: in each micro-batch's forward layer loop ONE
    all-gather per layer; in its backward loop the remat's re-gather and ONE
    reduce-scatter per layer; the leaves outside the stack gathered once per micro-batch
    (and their gradients reduce-scattered once); nothing gathered after the update."""
    k = 2
    step = shared_step(3, 4, k)
    compiled = step.compile(step.init(stacked_params()), batches()[0])
    found = jaxdp.testing.collectives(compiled)
    in_layers = [c for c in found if len(loops(c)) == 2]
    assert all(loops(c) == [k, LAYERS] for c in in_layers), jaxdp.testing.format_report(found)
    gathers = [c for c in in_layers if c.kind == "all-gather"]
    scatters = [c for c in in_layers if c.kind == "reduce-scatter"]
    assert [c.executions for c in gathers] == [(k * LAYERS, k * LAYERS)] * 2
    assert [c.executions for c in scatters] == [(k * LAYERS, k * LAYERS)]
    # Each moves one layer's split leaves: w (8 x 8) and b (8) in float64.
    assert {c.bytes for c in gathers + scatters} == {8 * (WIDTH * WIDTH + WIDTH)}
    per_micro_batch = [c for c in found if loops(c) == [k] and c.kind != "all-reduce"]
    assert sorted(c.kind for c in per_micro_batch) == ["all-gather", "reduce-scatter"]
    outside = [c for c in found if not loops(c)]
    assert not [c for c in outside if c.kind != "all-reduce"], jaxdp.testing.format_report(found)
    jaxdp.testing.assert_collectives(
        compiled,
        all_gather=k * (2 * LAYERS + 1),
        reduce_scatter=k * (LAYERS + 1),
        all_reduce=None,
        branch="applied",
    )


def test_comm_dtype_sends_the_gradients_reduce_scatters_in_bfloat16():
    """The gathers' backward is stage 2's packed reduce-scatter, so comm_dtype applies to
    both (the layer loop's and the one outside it); the gathers send the parameters' own
    dtype. Read from the program jaxdp hands XLA (XLA:CPU widens bfloat16 reductions)."""
    step = jaxdp.make_train_step(
        loss,
        optimizer(),
        mesh=jaxdp.data_mesh(4),
        accum_steps=2,
        parallel=jaxdp.Parallel(zero_stage=3, comm_dtype="bfloat16", layers=STACK),
    )
    hlo = step.lower(step.init(stacked_params()), batches()[0]).compiler_ir("hlo").as_hlo_text()
    found = jaxdp.testing.collectives(hlo)
    scatters = [c.shapes[0] for c in found if c.kind == "reduce-scatter"]
    gathers = [c.shapes[0] for c in found if c.kind == "all-gather"]
    assert len(scatters) == 2 and all(s.startswith("bf16[") for s in scatters), scatters
    assert gathers and all(s.startswith("f64[") for s in gathers), gathers


def memory(stage, num_devices, layers, width, rows, loss_fn=loss, remat="dots"):
    """XLA's memory analysis of a step (K = 1) of a stack of ``layers`` of ``width`` (the
    stack declared when ``loss_fn`` loops over it with scan_layers)."""
    stack = None if loss_fn is unscanned_loss else STACK
    step = make(stage, num_devices, 1, loss_fn=loss_fn, remat=remat, layers=stack)
    compiled = step.compile(step.init(stacked_params(layers=layers, width=width)), data(rows=rows))
    return jaxdp.plan.compiled_memory(compiled)


# The programs the resident-bytes test and the closed form's cells share, compiled once
# (the unscanned one is not: its warning is given while tracing).
shared_memory = functools.cache(memory)


def test_resident_bytes_are_a_quarter_and_the_peak_holds_one_layer():
    """Measured (jax 0.10.2, XLA:CPU): arguments 820,604 bytes at stage 3 against
    3,225,980 at stage 0; per added layer the temporaries grow by 137,728 bytes scanned
    (a layer's gradient block, 131,584, and its carry); 6 layers unscanned hold
    6,452,272 bytes of temporaries (every gathered layer of 526,336 and its gradient)."""
    width, rows = 256, 4  # per device: a layer's weights 514 KiB, the carry 8 KiB
    stage_0, stage_3 = (shared_memory(stage, 4, 2, width, 4 * rows) for stage in (0, 3))
    params = stacked_params(layers=2, width=width)
    whole = 8 * (params["head"]["w"].size + params["head"]["b"].size)
    batch = 8 * rows * (IN + OUT)
    # Parameters and AdamW's two moments (3 copies): a quarter, plus the leaves kept
    # whole on every device, the step counters (64 bytes at most) and the batch rows.
    assert stage_3.arguments <= (stage_0.arguments - batch) / 4 + 3 * whole + 64 + batch
    layer, carry = 8 * (width * width + width), 8 * rows * width
    growth = (shared_memory(3, 4, 6, width, 4 * rows).temporaries - stage_3.temporaries) / 4
    # Per added layer: its gradient block (the accumulator's quarter) and its saved
    # carry, never its gathered weights: the loop holds one layer at a time.
    assert growth <= layer / 4 + 4 * carry < layer / 2
    with pytest.warns(UserWarning, match="peak memory is not reduced"):
        unscanned = memory(3, 4, 6, width, 4 * rows, unscanned_loss).temporaries
    assert unscanned >= 6 * layer  # without scan_layers: every layer's weights at once


# Stage 3's temporaries in closed form (docs/scaling-out.md, "Which ZeRO stage"), float64
# bytes: one gathered layer and its whole gradient before the reduce-scatter (2 layers);
# per layer its saved carry, what the remat keeps of it (remat="dots": its one matrix
# product's output, carry-sized; "full": nothing) and its gradient block (layer / N); the
# activations outside the loop, carry-sized here: the embedding's pre-activation and
# output, the norm's centred and scaled copies, the carry's cotangent into and out of the
# loop (6).
ROOT_ACTIVATIONS = 6
KEPT_PER_LAYER = {"dots": 1, "full": 0}


@pytest.mark.parametrize(
    "num_devices, layers, width, rows, remat",
    [
        (4, 2, 256, 16, "dots"),  # the weights dominate
        (4, 6, 256, 16, "full"),
        (2, 4, 128, 256, "dots"),  # both
        (4, 12, 32, 2048, "dots"),  # the activations dominate
        (4, 12, 32, 2048, "full"),
        (1, 6, 32, 2048, "full"),  # one device: nothing split, the layers still rematerialized
    ],
)
def test_temporaries_are_within_a_quarter_of_the_closed_form(
    num_devices, layers, width, rows, remat
):
    """Measured (jax 0.10.2, XLA:CPU): 0.87x to 1.02x the closed form. Before every
    stage-3 loop was rematerialized, one device held 2.0x: every layer's activations."""
    measured = shared_memory(3, num_devices, layers, width, rows, remat=remat).temporaries
    layer, carry = 8 * (width * width + width), 8 * rows // num_devices * width
    kept = (1 + KEPT_PER_LAYER[remat]) * carry + layer / num_devices
    form = 2 * layer + layers * kept + ROOT_ACTIVATIONS * carry
    assert form / 1.25 <= measured <= 1.25 * form, (measured, form, measured / form)


def test_a_step_without_a_declared_stack_is_warned_once():
    # That it trains as one device on the big batch: test_equivalence.py's grid.
    step = make(3, 2, 2, loss_fn=unscanned_loss, layers=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step.lower(step.init(stacked_params()), batches()[0])
    said = [w for w in caught if "jaxdp.scan_layers" in str(w.message)]
    assert len(said) == 1 and said[0].category is UserWarning
    assert "no stack of layers is declared" in str(said[0].message)
    assert "peak memory is not reduced" in str(said[0].message)


def regularized_loss(params, batch):
    """The stack's weights also used outside the layer loop."""
    return loss(params, batch) + 1e-2 * jnp.sum(params["blocks"]["w"] ** 2)


def transformed_loss(params, batch):
    """The stack transformed before the loop: other arrays than the step handed over."""
    x, y = batch
    blocks = jax.tree.map(lambda p: p * 0.5, params["blocks"])
    h = jnp.tanh(x @ params["embed"]["w"] + params["embed"]["b"])
    h = normed(params["norm"]["scale"], jaxdp.scan_layers(block, blocks, h))
    return jnp.mean((h @ params["head"]["w"] + params["head"]["b"] - y) ** 2)


@pytest.mark.parametrize(
    "loss_fn", [regularized_loss, transformed_loss], ids=["used_outside", "transformed"]
)
def test_a_declared_stack_used_outside_the_loop_is_refused_naming_it(loss_fn):
    """Never computed on as a block: a use of a declared stack other than scan_layers' is
    refused while the step is first traced, naming the leaf and the way out."""
    step = make(3, 4, 2, loss_fn=loss_fn)
    with pytest.raises(TypeError, match=r"params\['blocks'\]\['[wb]'\] is a stack of layers"):
        step(step.init(stacked_params()), batches()[0])


def test_a_non_finite_update_is_skipped_at_stage_3():
    step = shared_step(3, 4, 2)
    state = step.init(stacked_params())
    x, y = batches()[0]
    new, metrics = step(state, (x, np.full_like(y, np.nan)))
    assert bool(metrics["skipped"]) and int(new.step) == 0
    assert_trees_close(step.model(new), stacked_params(), rtol=0, atol=0.0)


def test_scan_layers_outside_a_step_is_the_loop():
    params, x = stacked_params(), np.random.default_rng(2).normal(size=(5, WIDTH))
    expected = unrolled(block, params["blocks"], x)
    np.testing.assert_allclose(jaxdp.scan_layers(block, params["blocks"], x), expected, rtol=1e-14)


def test_bad_input_is_refused_naming_it():
    with pytest.raises(ValueError, match="zero_stage=3 needs strategy='shard_map'"):
        jaxdp.Parallel(zero_stage=3, strategy="pmap")
    with pytest.raises(ValueError, match=r"zero_stage=4 must be 0, 1, 2 or 3"):
        jaxdp.Parallel(zero_stage=4)
    h = jnp.zeros((2, WIDTH))
    unequal = {"w": jnp.zeros((3, WIDTH, WIDTH)), "b": jnp.zeros((2, WIDTH))}
    with pytest.raises(ValueError, match=r"layers\['b'\] has 2 layers .* layers\['w'\] has 3"):
        jaxdp.scan_layers(block, unequal, h)
    with pytest.raises(ValueError, match=r"layers\['b'\] is a scalar"):
        jaxdp.scan_layers(block, {"w": jnp.zeros((3, WIDTH, WIDTH)), "b": jnp.zeros(())}, h)
    with pytest.raises(ValueError, match="layers has no array leaf"):
        jaxdp.scan_layers(block, {}, h)
    # Issue 44: one layer, or layers in a Sequential, failed inside JAX or flax
    # ("Incompatible shapes for broadcasting") on slices of one layer's weights.
    linears = [nnx.Linear(16, 16, rngs=nnx.Rngs(i)) for i in range(3)]
    stack = r"scan_layers: layers must be a stack of layers on a leading \(layer\) axis, one "
    stack += r"module built with nnx.vmap \(or a pytree of stacked leaves\); got "
    one = r"one nnx.Linear \(kernel of shape \(16, 16\): one layer's, no layer axis\)"
    for layers, got in [
        (linears[0], one),
        (nnx.Sequential(*linears), rf"nnx.Sequential, whose layers.layers\[0\] is {one}"),
    ]:
        with pytest.raises(ValueError, match=stack + got):
            jaxdp.scan_layers(lambda layer, h: layer(h), layers, jnp.zeros((2, 16)))


def test_a_state_padded_for_another_layout_is_refused_naming_the_leaf():
    """A stage-3 state holds the head padded (8 x 3 as 8 x 4 on 4 devices); a step that
    holds it otherwise (stage 0: as the model's; 8 devices' stage 3 would pad to 8 x 8)
    refuses it while tracing, naming the leaf and both shapes."""
    state = shared_step(3, 4, 2).init(stacked_params())
    said = r"state.params\['head'\]\['b'\] has shape \(4,\); this step \(zero_stage=0\) holds "
    with pytest.raises(ValueError, match=said + r"it as \(3,\) \(as the model's\)"):
        make(0, 4, 2)(state, batches()[0])

"""A model's own sharding names (issue 49).

On a mesh that lacks the axis they name (a tensor-parallel "model" on a data mesh) they
are refused when the step is given the model, naming the leaf, the axis and the mesh's
axes: the leaf would not have been split over that axis, without a word. Names of the
mesh's own data axis, of a stack's layer axis, and logical names that the model's rules
map to no axis are taken, and train as the model without them.

On a mesh with the model's axis beside the data axis (``Parallel(model_axes=...)``) every
leaf rests split as its metadata says: the parameters, Adam's moments, the window's sums,
a restored checkpoint; the gradients travel over the data axis once per step. That it
trains as one device on the big batch is the equivalence grid's (test_equivalence.py)."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from models import MegatronMLP, megatron_loss, regression_data

import jaxdp
from jaxdp.testing import TOLERANCES, assert_trees_close, collectives


class NnxMLP(nnx.Module):
    def __init__(self, names):
        rngs = nnx.Rngs(0)
        meta = {} if names is None else {"out_sharding": names, "eager_sharding": False}
        self.fc1 = nnx.Linear(4, 8, rngs=rngs, kernel_metadata=meta)
        self.fc2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def nnx_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


class LinenDense(nn.Module):
    names: tuple | None
    logical: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        if self.names is not None:
            wrap = nn.with_logical_partitioning if self.logical else nn.with_partitioning
            init = wrap(init, self.names)
        return jnp.tanh(x @ self.param("w", init, (4, 2)))


def batch():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32)


def make_step(loss):
    return jaxdp.make_train_step(loss, optax.sgd(0.1), mesh=jaxdp.data_mesh(2))


def linen(names, logical=False):
    module = LinenDense(names, logical)
    params = module.init(jax.random.key(0), jnp.ones((1, 4)))["params"]

    def loss(p, batch):
        x, y = batch
        return jnp.mean((module.apply({"params": p}, x) - y) ** 2)

    return params, loss


def trained(step, model):
    state, _ = step(step.init(model), batch())
    return jax.device_get(jax.tree.leaves(step.model(state)))


def test_an_nnx_kernel_split_over_a_model_axis_is_refused_on_a_data_mesh():
    step = make_step(nnx_loss)
    with pytest.raises(ValueError) as refused:
        step.init(NnxMLP((None, "model")))
    said = str(refused.value)
    assert "params['fc1']['kernel']'s sharding metadata ((None, 'model'))" in said, said
    assert "names the mesh axis 'model', which the mesh lacks (its axes: ('data',))" in said
    assert "by its own rule over the mesh's data axes only" in said
    assert "name it in Parallel(model_axes=...)" in said


@pytest.mark.parametrize("names", [(None, None), ("data", None)])
def test_names_of_the_meshs_own_axes_train_as_the_model_without_them(names):
    annotated = trained(make_step(nnx_loss), NnxMLP(names))
    assert_trees_close(annotated, trained(make_step(nnx_loss), NnxMLP(None)))


def test_a_linen_param_with_partitioning_over_a_model_axis_is_refused():
    params, loss = linen((None, "model"))
    with pytest.raises(
        ValueError, match=r"params\['w'\]'s sharding metadata \(\(None, 'model'\)\)"
    ):
        make_step(loss).init(params)


def test_logical_names_are_read_through_the_rules_in_force():
    """Linen's logical names map through ``nn.logical_axis_rules`` (in force when the
    step is given the model): to ``model`` refused, to no axis taken; the refusal says
    both the names and what they map to."""
    params, loss = linen(("embed", "mlp"), logical=True)
    with nn.logical_axis_rules([("mlp", "model")]), pytest.raises(ValueError) as refused:
        make_step(loss).init(params)
    assert "(('embed', 'mlp'), by its rules (None, 'model'))" in str(refused.value)
    with nn.logical_axis_rules([("mlp", None)]):
        annotated = trained(make_step(loss), params)
    plain, plain_loss = linen(None)
    assert_trees_close(annotated, trained(make_step(plain_loss), plain))


def test_nnx_logical_names_are_read_as_nnx_reads_them():
    """An NNX Variable's names map through the ``nnx.logical_axis_rules`` in force (and
    its own ``sharding_rules``) as ``nnx.get_partition_spec`` maps them: to ``model``
    refused, to no axis taken; a name no rule maps stays a mesh axis name, as NNX
    places it, and is refused when the mesh lacks it."""
    step = make_step(nnx_loss)
    model = NnxMLP(("embed", "mlp"))
    rules = [("embed", None), ("mlp", "model")]
    with nnx.logical_axis_rules(rules), pytest.raises(ValueError) as refused:
        step.init(model)
    assert "(('embed', 'mlp'), by its rules (None, 'model'))" in str(refused.value)
    with pytest.raises(ValueError, match="names the mesh axis 'embed'"):
        step.init(model)
    with nnx.logical_axis_rules([("embed", None), ("mlp", None)]):
        annotated = trained(step, model)
    assert_trees_close(annotated, trained(make_step(nnx_loss), NnxMLP(None)))


def test_a_named_sharding_is_read_by_its_spec():
    """``out_sharding`` may be a ``NamedSharding`` (a mesh of its own): its spec's axes
    are the names, refused on a mesh that lacks them."""
    devices = np.array(jax.devices()[:1]).reshape(1, 1)
    theirs = jax.sharding.NamedSharding(
        jax.sharding.Mesh(devices, ("data", "model")), jax.sharding.PartitionSpec(None, "model")
    )
    with pytest.raises(ValueError, match=r"\(\(None, 'model'\)\) names the mesh axis 'model'"):
        make_step(nnx_loss).init(NnxMLP(theirs))


# ---- the model's own axis on the mesh (tensor parallelism) -----------------------------

P = jax.sharding.PartitionSpec


def tp_mesh(data=4, model=2, axes=("data", "model")):
    """A (data, model) mesh whose axes XLA's partitioner takes (Auto)."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((data, model)[: len(axes)], axes, axis_types=auto[: len(axes)])


def tp_step(stage=1, path="multisteps", data=4, model=2, accum_steps=2, **parallel):
    return jaxdp.make_train_step(
        megatron_loss,
        optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
        mesh=tp_mesh(data, model),
        accum_steps=accum_steps,
        path=path,
        parallel=jaxdp.Parallel(zero_stage=stage, model_axes=("model",), **parallel),
    )


def specs(tree):
    return [x.sharding.spec for x in jax.tree.leaves(tree)]


def test_the_models_splits_are_what_the_state_holds_at_rest():
    """On a (data 4, model 2) mesh at stage 1: each parameter rests split over "model" as
    its metadata says (fc1 column-split, fc2 row-split, fc2's bias whole), Adam's moments
    as their parameters, each also split over "data" along a dimension the model split
    leaves free where 4 divides one (fc1's kernel: its rows), the multisteps window's sums
    as their parameters behind their per-device rows; abstract_state says the same, and
    a step keeps it."""
    step = tp_step()
    # jax.tree.leaves order: fc1 bias, fc1 kernel, fc2 bias, fc2 kernel.
    params = [P("model"), P(None, "model"), P(), P("model")]
    moments = [P("model"), P("data", "model"), P(), P("model")]
    window = [P("data", "model"), P("data", None, "model"), P("data"), P("data", "model")]
    state = step.init(MegatronMLP())
    abstract = step.abstract_state(MegatronMLP())
    x, y = regression_data(16)
    for s in (state, abstract, step(state, (x[:8], y[:8]))[0]):
        assert specs(s.params) == params
        adam = s.opt_state[1][0]
        assert specs(adam.mu) == moments and specs(adam.nu) == moments
        assert specs(s.window.grads) == window


def test_one_gradient_reduction_over_data_per_step_and_megatrons_over_model():
    """The fused step at K = 4 on (data 4, model 2): the gradients' all-reduce over the
    data groups (4 devices) after the micro-batch loop, none in it, each device sending
    its own model shard; in the loop, the all-reduces over the model groups (2 devices)
    that fc2's row split needs, XLA's."""
    step = tp_step(stage=0, path="fused", accum_steps=4)
    state = step.init(MegatronMLP())
    compiled = step.compile(state, regression_data(32))
    found = collectives(compiled)
    data = [c for c in found if c.devices == 4]
    model = [c for c in found if c.devices == 2]
    assert data and not [c for c in data if c.in_loop], [c.context for c in data]
    assert {c.kind for c in data} == {"all-reduce"}
    # Each device sends its model shard of the gradients (and the loss and weight sums):
    # fc1's kernel and bias and fc2's kernel halved over the model axis, fc2's bias whole.
    mine = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * 8 for x in jax.tree.leaves(state.params)
    )
    assert mine == (8 * 16 // 2 + 16 // 2 + 16 * 3 // 2 + 3) * 8
    assert mine <= sum(c.bytes for c in data) <= mine + 64
    assert [c for c in model if c.in_loop and c.kind == "all-reduce"]
    # Nothing over all 8 devices: the data and model groups stay apart.
    assert not [c for c in found if c.devices == 8], [c for c in found if c.devices == 8]


# Per stage, the kinds of collective over the data groups in the micro-batch loop: stage
# 2's reduce-scatter per micro-batch, stage 3's gather and its reduce-scatter.
IN_LOOP = {1: set(), 2: {"reduce-scatter"}, 3: {"all-gather", "reduce-scatter"}}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_stages_collectives_go_over_data_on_each_devices_model_shards(stage):
    """The fused step at K = 4 on (data 4, model 2), stages 1 to 3: jaxdp's collectives
    (reduce-scatters, gathers) run over the data groups on each device's own model shards,
    so over the model groups only the all-reduces the model's layout needs run (fc2's
    partial sums in the loop, the clip's norm after it): no gather or reduce-scatter
    there, which XLA added when a packed buffer of model-split leaves crossed the data
    axis. Stage 3 splits fc1's kernel over both axes (its rows over data: the model axis
    takes its columns) and gathers each device's block of it over data alone."""
    step = tp_step(stage=stage, path="fused", accum_steps=4)
    with warnings.catch_warnings():  # stage 3, no stack declared: it says so
        warnings.filterwarnings("ignore", ".*peak memory is not reduced", UserWarning)
        state = step.init(MegatronMLP())
        found = collectives(step.compile(state, regression_data(32)))
    data = [c for c in found if c.devices == 4]
    model = [c for c in found if c.devices == 2]
    assert {c.kind for c in model} == {"all-reduce"}, [(c.kind, c.bytes) for c in model]
    assert [c for c in model if c.in_loop]
    assert {c.kind for c in data if c.in_loop} == IN_LOOP[stage]
    assert not [c for c in found if c.devices == 8]
    if stage == 3:
        assert specs(state.params)[1] == P("data", "model")
        # The gather's result: the data group's blocks of this device's model shards.
        blocks = sum(
            math.prod(x.sharding.shard_shape(x.shape)) * 8
            for x in jax.tree.leaves(state.params)
            if "data" in x.sharding.spec
        )
        gathers = [c for c in data if c.kind == "all-gather"]
        assert sum(c.bytes for c in gathers) == 4 * blocks


def test_a_tensor_parallel_state_resumes_at_another_model_size_and_stage(tmp_path):
    """Saved on (data 4, model 2) at stage 1 after a step, restored on (data 2, model 4)
    at stage 2: the leaves are whole arrays on disk, laid out as the restoring step keeps
    them, and its next step ends where one device's big batches do."""
    batches = [regression_data(32, seed=s) for s in (1, 2)]
    saved = tp_step(stage=1, path="fused", accum_steps=2)
    state, _ = saved(saved.init(MegatronMLP()), batches[0])
    checkpoints = jaxdp.checkpoint.Checkpoints(tmp_path / "ckpt")
    sizes = jaxdp.batch_sizes(num_devices=4, accum_steps=2, global_batch_size=32)
    checkpoints.save(state, position=jaxdp.SamplerPosition(0, 1, 0), sizes=sizes, samples=32)
    other = tp_step(stage=2, path="fused", data=2, model=4, accum_steps=2)
    sizes = jaxdp.batch_sizes(num_devices=2, accum_steps=2, global_batch_size=32)
    restored = checkpoints.restore(other.init(MegatronMLP()), sizes=sizes).state
    assert specs(restored.params) == [P("model"), P(None, "model"), P(), P("model")]
    assert specs(restored.opt_state[1][0].mu)[1] == P("data", "model")
    state, _ = other(restored, batches[1])
    graphdef, expected = nnx.split(MegatronMLP(), nnx.Param)
    optimizer = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
    opt_state = optimizer.init(expected)
    for batch in batches:
        grads = jax.grad(lambda p, b: megatron_loss(nnx.merge(graphdef, p), b))(expected, batch)
        updates, opt_state = optimizer.update(grads, opt_state, expected)
        expected = optax.apply_updates(expected, updates)
    f64 = TOLERANCES["float64"]
    assert_trees_close(jax.tree.leaves(state.params), jax.tree.leaves(expected), rtol=f64.rtol)


@pytest.mark.parametrize(
    ("mesh_axes", "parallel", "said"),
    [
        (("data", "model"), {}, "mesh has axes ('data', 'model'), and jaxdp's step takes one"),
        (
            ("data", "model"),
            {"model_axes": ("tensor",)},
            "parallel.model_axes=('tensor',) names axes the mesh lacks: ['tensor']",
        ),
        (
            ("data", "model"),
            {"model_axes": ("data", "model")},
            "every axis is a model axis",
        ),
        (
            ("data", "model"),
            {"model_axes": "model", "strategy": "pmap"},
            "model_axes=('model',) needs strategy='shard_map'",
        ),
        (("data",), {"model_axes": [1]}, "model_axes=[1] must be a sequence of distinct"),
        ((), {"model_axes": "model"}, "the mesh's axes ['model'] are AxisType.Explicit"),
    ],
)
def test_the_model_axes_are_checked_before_any_work(mesh_axes, parallel, said):
    with pytest.raises(ValueError) as refused:
        jaxdp.make_train_step(
            megatron_loss,
            optax.sgd(0.1),
            mesh=tp_mesh(axes=mesh_axes) if mesh_axes else jax.make_mesh((4, 2), ("data", "model")),
            parallel=jaxdp.Parallel(**parallel),
        )
    assert said in str(refused.value), str(refused.value)


def test_the_reference_stack_carries_its_megatron_plan():
    """``build_model("stack", tp=True)``: fc column-split and proj row-split over
    MODEL_AXIS behind the stack's layer axis; a model without a plan is refused."""
    from jaxdp.models import MODEL_AXIS, TENSOR_PARALLEL, build_model

    assert "stack" in TENSOR_PARALLEL and MODEL_AXIS == "model"
    blocks = build_model("stack", tp=True).blocks
    assert blocks.fc.kernel.get_metadata()["out_sharding"] == ("layers", None, MODEL_AXIS)
    assert blocks.proj.kernel.get_metadata()["out_sharding"] == ("layers", MODEL_AXIS, None)
    with pytest.raises(ValueError, match="model 'mlp' has no tensor-parallel plan"):
        build_model("mlp", tp=True)


def replica_groups(compiled, collective):
    """``collective``'s groups as sets of device ids."""
    return {frozenset(g) for g in collective.groups}


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_hsdp_with_a_model_axis_gathers_within_shard_groups_and_reduces_across_once(path):
    """HSDP x TP: (data 4, model 2) with shards=2 is the (replica 2, shard 2, model 2)
    mesh. Stage 3's gathers and reduce-scatters run within the shard groups (in the
    micro-batch loop at K = 4), ONE all-reduce of the blocks across the replica groups
    after it, each device sending its own blocks of its model shards; over the model
    groups only the all-reduces the model's layout needs."""
    k = 4 if path == "fused" else 1
    step = tp_step(stage=3, path=path, accum_steps=k, shards=2)
    mesh = step.options.device_mesh
    assert mesh.axis_names == ("replica", "data", "model") and mesh.devices.shape == (2, 2, 2)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)

    def along(axis):
        return {frozenset(v.tolist()) for v in np.moveaxis(ids, axis, -1).reshape(-1, 2)}

    with warnings.catch_warnings():  # no stack declared: it says so
        warnings.filterwarnings("ignore", ".*peak memory is not reduced", UserWarning)
        state = step.init(MegatronMLP())
        compiled = step.compile(state, regression_data(32 if path == "fused" else 8))
    assert specs(state.params)[1] == P("data", "model")
    found = [(c, replica_groups(compiled, c)) for c in collectives(compiled) if c.devices == 2]
    shard = [c for c, g in found if g == along(1)]
    replica = [c for c, g in found if g == along(0)]
    model = [c for c, g in found if g == along(2)]
    assert len(shard) + len(replica) + len(model) == len(found)
    # Beside them in the shard groups only the update's scalars (the clip's norm of the
    # leaves split over the data axis, partitioned by XLA outside the map).
    moving = [c for c in shard if c.kind != "all-reduce"]
    assert {c.kind for c in moving} == {"all-gather", "reduce-scatter"}
    assert all(c.in_loop for c in moving) is (path == "fused")
    scalars = [c for c in shard if c.kind == "all-reduce"]
    assert all(s.endswith("[]") for c in scalars for s in c.shapes), [c.shapes for c in scalars]
    assert not [c for c in scalars if c.in_loop]
    assert {c.kind for c in model} == {"all-reduce"}
    assert [c.kind for c in replica] == ["all-reduce"] and not replica[0].in_loop
    blocks = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * 8
        for x in jax.tree.leaves(state.params)
        if "data" in x.sharding.spec
    )
    assert replica[0].bytes == blocks


@pytest.mark.parametrize(("stage", "shards"), [(0, None), (2, None), (3, 2)])
def test_a_routed_stack_with_a_model_axis_sends_each_devices_model_shards(stage, shards):
    """The reference stack with its Megatron plan (``build_model("stack", tp=True)``), in
    the spelling of GPUs (each layer's gradients leave scan_layers' backward as it ends:
    psum at stage 0, reduce-scatter at stage 2; under HSDP, stage 3's gathers and the
    all-reduce across the replica groups a layer later) on (data 4, model 2), fused at
    K = 2: one step equals plain optax on the big batch, and over the model groups only
    all-reduces run (each route's packed buffer goes on this device's own model shards;
    left to XLA it was gathered over the model axis first, in every layer)."""
    from jaxdp.models import build_model, model_loss

    loss, rows = model_loss("stack"), np.random.default_rng(0)
    batch = (rows.normal(size=(32, 6)), rows.integers(0, 5, size=(32,)))
    optimizer = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
    with jaxdp.testing.plain_spelling():
        step = jaxdp.make_train_step(
            loss,
            optimizer,
            mesh=tp_mesh(4, 2),
            accum_steps=2,
            parallel=jaxdp.Parallel(zero_stage=stage, shards=shards, model_axes=("model",)),
        )
    state = step.init(build_model("stack", param_dtype=jnp.float64, tp=True))
    compiled = step.compile(state, batch)
    ids = np.vectorize(lambda d: d.id)(step.options.device_mesh.devices)
    model_groups = {frozenset(v.tolist()) for v in ids.reshape(-1, 2)}  # the last axis
    over_model = [c for c in collectives(compiled) if replica_groups(compiled, c) == model_groups]
    assert over_model and {c.kind for c in over_model} == {"all-reduce"}, [
        (c.kind, c.bytes) for c in over_model
    ]
    state, _ = step(state, batch)
    graphdef, expected = nnx.split(
        build_model("stack", param_dtype=jnp.float64, tp=True), nnx.Param
    )
    grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p), batch))(expected)
    updates, _ = optimizer.update(grads, optimizer.init(expected), expected)
    expected = optax.apply_updates(expected, updates)
    got = nnx.state(step.model(state), nnx.Param)
    f64 = TOLERANCES["float64"]
    assert_trees_close(jax.tree.leaves(got), jax.tree.leaves(expected), rtol=f64.rtol)


def test_the_reference_transformer_trains_under_its_megatron_plan_as_one_device():
    """``build_model("transformer", tp=True)``: query, key, value and fc column-split over
    MODEL_AXIS (their biases with them: whole heads per device), both projs row-split
    (biases whole), embeddings, norms and head whole, the parameters tp=False draws. One
    step on (data 2, model 2) at stage 1 keeps that split and ends where one device's step
    on the big batch does (float64); a model axis that would split a head is refused."""
    from jaxdp.models import MODEL_AXIS, TENSOR_PARALLEL, build_model, check_tp, model_loss

    assert "transformer" in TENSOR_PARALLEL
    model = build_model("transformer", param_dtype=jnp.float64, tp=True)
    attn, mlp = model.block.attn, model.block.mlp
    col, row = (None, MODEL_AXIS), (MODEL_AXIS, None)
    for linear, kernel, bias in [
        (attn.query, col, (MODEL_AXIS,)),
        (attn.key, col, None),  # no bias
        (attn.value, col, (MODEL_AXIS,)),
        (attn.proj, row, (None,)),
        (mlp.fc, col, (MODEL_AXIS,)),
        (mlp.proj, row, (None,)),
    ]:
        assert linear.kernel.get_metadata()["out_sharding"] == kernel
        assert bias is None or linear.bias.get_metadata()["out_sharding"] == bias
    for whole in (model.tok_emb.embedding, model.head.kernel, model.block.ln1.scale):
        assert "out_sharding" not in whole.get_metadata()
    # jax.tree.leaves order: attn.key.kernel, attn.proj.bias, attn.proj.kernel, attn.query.bias,
    # attn.query.kernel, attn.value.bias, attn.value.kernel, ln1, ln2 (bias, scale each),
    # mlp.fc.bias, mlp.fc.kernel, mlp.proj.bias, mlp.proj.kernel; head, ln_f, embeddings.
    split = [P(None, "model"), P(), P("model"), P("model"), P(None, "model")]
    split += [P("model"), P(None, "model"), *[P()] * 4, P("model"), P(None, "model")]
    split += [P(), P("model"), *[P()] * 5]

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32, size=(8, 8)).astype(np.int32)
    targets = rng.integers(0, 32, size=(8, 8)).astype(np.int32)
    optimizer = optax.adamw(1e-2)
    step = jaxdp.make_train_step(
        model_loss("transformer"),
        optimizer,
        mesh=tp_mesh(2, 2),
        accum_steps=2,
        parallel=jaxdp.Parallel(zero_stage=1, model_axes=("model",)),
    )
    state, _ = step(step.init(model), (tokens, targets))
    assert specs(state.params) == split

    plain = build_model("transformer", param_dtype=jnp.float64)
    graphdef, params = nnx.split(plain, nnx.Param)
    loss = model_loss("transformer")
    grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p), (tokens, targets)))(params)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    expected = optax.apply_updates(params, updates)
    assert_trees_close(jax.tree.leaves(state.params), jax.tree.leaves(expected))

    check_tp(model, 2)
    with pytest.raises(ValueError, match="tp=4 must divide the 2 attention heads of block.attn"):
        check_tp(model, 4)


def test_megatrons_plan_keeps_a_stacks_layer_axis():
    """``with_megatron_plan`` on the scanned GPT (``jaxdp train --tp``'s): each stacked
    block's Linears split as the Transformer's, behind the stack's layer axis; the norms
    stay whole and no value changes."""
    from jaxdp.models import ScannedTransformer, with_megatron_plan

    model = ScannedTransformer(rngs=nnx.Rngs(0))
    before = jax.tree.leaves(nnx.state(model))
    assert with_megatron_plan(model) is model
    blocks = model.blocks

    def names(variable):
        return variable.get_metadata()["out_sharding"]

    assert names(blocks.attn.query.kernel) == ("layers", None, "model")
    assert names(blocks.attn.query.bias) == ("layers", "model")
    assert names(blocks.mlp.proj.kernel) == ("layers", "model", None)
    assert names(blocks.mlp.proj.bias) == ("layers", None)
    assert names(blocks.ln1.scale) == ("layers", None)
    assert "out_sharding" not in model.tok_emb.embedding.get_metadata()
    assert_trees_close(jax.tree.leaves(nnx.state(model)), before, rtol=0, atol=0)

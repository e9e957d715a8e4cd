"""HSDP (``Parallel(zero_stage=3, shards=S)``: replicas x shards) and stage 3's gather
choices (``regather``, ``gather_dtype``): the collectives over the right device groups
(read from the compiled program), the layout at rest, and the choices' updates. That HSDP
trains as one device on the big batch is test_equivalence.py's grid."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import train
from test_stage3 import (
    LAYERS,
    STACK,
    assert_same_training,
    batches,
    loss,
    optimizer,
    reference,
    stacked_params,
    trained,
)

import jaxdp
from jaxdp._options import StepOptions

# test_stage3.py's cached reference runs and these: one worker runs them all.
pytestmark = pytest.mark.xdist_group("stage3")

SHARD_GROUPS = {frozenset({0, 1}), frozenset({2, 3})}  # 2 x 2: devices r * 2 + s
REPLICA_GROUPS = {frozenset({0, 2}), frozenset({1, 3})}


def make(num_devices=4, accum_steps=3, path="fused", loss_fn=loss, **parallel):
    parallel.setdefault("zero_stage", 3)
    if parallel["zero_stage"] == 3:
        parallel.setdefault("layers", STACK)  # the stack of stacked_params, declared
    return jaxdp.make_train_step(
        loss_fn,
        optimizer(),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        path=path,
        parallel=jaxdp.Parallel(**parallel),
    )


@functools.cache  # the 2 x 2 step and its run (K=3), for the tests that read them
def hsdp(path):
    step = make(path=path, shards=2)
    return step, train(step, stacked_params(), batches())


def collectives_with_groups(compiled):
    """jaxdp.testing.collectives of ``compiled``, each with its device groups
    (``Collective.groups``, read from each of XLA's spellings) as sets."""
    return [
        (c, {frozenset(g) for g in c.groups}) for c in jaxdp.testing.collectives(compiled.as_text())
    ]


def loops(c):
    return [int(w.rsplit("x", 1)[1]) for w in c.context if w.startswith("while")]


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_reduce_scatters_stay_in_shard_groups_and_replicas_all_reduce_once(path):
    """2 x 2, K=3: every gather and reduce-scatter runs within a shard group, inside the
    micro-batch loop (fused) or in every call (multisteps); the blocks' all-reduce
    across the replica groups runs once per step, after the loop (multisteps: only in
    the branch that ends the window) and carries one device's blocks."""
    step, (state, _) = hsdp(path)
    batch = batches()[0]
    if path == "multisteps":
        batch = jax.tree.map(lambda x: x[:8], batch)  # one call: one micro-batch per device
    compiled = step.compile(state, batch)  # the program the run ran
    found = collectives_with_groups(compiled)
    report = jaxdp.testing.format_report([c for c, _ in found])
    moving = [(c, g) for c, g in found if c.kind != "all-reduce"]
    assert {c.kind for c, _ in moving} == {"all-gather", "reduce-scatter"}, report
    assert all(g == SHARD_GROUPS for _, g in moving), report
    if path == "fused":
        assert all(loops(c)[:1] == [3] for c, _ in moving), report
    across = [c for c, g in found if g == REPLICA_GROUPS]
    assert [c.kind for c in across] == ["all-reduce"], report
    (c,) = across
    # Every leaf, the head padded to 8 x 4 and 4 (3 does not divide by 2).
    split = {**stacked_params(), "head": {"w": np.zeros((8, 4)), "b": np.zeros(4)}}
    assert c.bytes == 8 * sum(x.size // 2 for x in jax.tree.leaves(split)), report
    assert not loops(c), report
    if path == "fused":
        assert c.executions == (1, 1), report
    else:  # inside the window's end only: a call that does not end it all-reduces nothing
        assert c.executions == (0, 1) and c.context[0].startswith("conditional"), report
        jaxdp.testing.assert_collectives(
            compiled,
            all_reduce=0,
            reduce_scatter=1 + LAYERS,
            all_gather=1 + 2 * LAYERS,
            branch="skipped",
        )


def test_each_device_holds_its_shard_groups_block_and_replicas_hold_equal_copies():
    step, (state, _) = hsdp("fused")  # after 3 steps: every step keeps the layout
    w, mu = state.params["blocks"]["w"], state.opt_state[1][0].mu["blocks"]["w"]
    for leaf in (w, mu):
        by_device = {s.device.id: np.asarray(s.data) for s in leaf.addressable_shards}
        assert {x.shape for x in by_device.values()} == {(LAYERS, 8, 4)}  # 1/S = 1/2
        mesh_ids = [d.id for d in step.mesh.devices.flat]
        first, second = ([by_device[mesh_ids[r * 2 + s]] for s in range(2)] for r in range(2))
        for a, b in zip(first, second, strict=True):  # replica group 0 == group 1, bitwise
            np.testing.assert_array_equal(a, b)
        assert not np.array_equal(*first)  # and the two blocks of a group differ
    # The head rests split too, padded (8 x 3 to 8 x 4: 8 x 2 per device, zeros in its last).
    head = state.params["head"]["w"]
    assert head.shape == (8, 4) and {s.data.shape for s in head.addressable_shards} == {(8, 2)}
    np.testing.assert_array_equal(np.asarray(head)[:, 3], 0)
    # The multisteps window: each replica group's own sums, split over its shard group.
    window = hsdp("multisteps")[1][0].window  # emptied after the run's last window, not resized
    grads = window.grads["blocks"]["w"]
    assert grads.shape == (2, LAYERS, 8, 8)
    assert {s.data.shape for s in grads.addressable_shards} == {(1, LAYERS, 8, 4)}


def test_regather_window_gathers_once_before_the_micro_batch_loop():
    """The same numbers as the default; the all-gathers outside the loop over K=3
    micro-batches (one per dtype: one), the reduce-scatters inside it, one per
    micro-batch, as at stage 2."""
    step = make(regather="window")
    window = train(step, stacked_params(), batches())
    assert_same_training(window, reference())
    found = jaxdp.testing.collectives(step.compile(window[0], batches()[0]))
    report = jaxdp.testing.format_report(found)
    gathers = [c for c in found if c.kind == "all-gather"]
    scatters = [c for c in found if c.kind == "reduce-scatter"]
    assert [(loops(c), c.executions) for c in gathers] == [([], (1, 1))], report
    assert [(loops(c), c.executions) for c in scatters] == [([3], (3, 3))], report


def rounded_loss(params, batch):
    """``loss`` on the split leaves, every one (the head padded), rounded to bfloat16,
    differentiated through the rounding."""

    def rounded(x):
        return x.astype(jnp.bfloat16).astype(x.dtype)

    return loss(jax.tree.map(rounded, params), batch)


def test_gather_dtype_bfloat16_gathers_in_bfloat16_and_computes_on_the_rounded_weights():
    """The gathers carry bfloat16 and the gradients' reduce-scatters float64; the run is
    stage 0 on weights rounded to bfloat16 with each device's gradient rounded to
    bfloat16 (the transpose of the rounding), to float64 rounding: the bound is the
    float64 one, the semantics named exactly."""
    step = make(shards=2, gather_dtype="bfloat16")
    hlo = step.lower(step.init(stacked_params()), batches()[0]).compiler_ir("hlo").as_hlo_text()
    found = jaxdp.testing.collectives(hlo)
    gathers = [c.shapes[0] for c in found if c.kind == "all-gather"]
    scatters = [c.shapes[0] for c in found if c.kind == "reduce-scatter"]
    assert gathers and all(s.startswith("bf16[") for s in gathers), gathers
    assert scatters and all(s.startswith("f64[") for s in scatters), scatters
    bf16 = train(step, stacked_params(), batches())
    # Stage 0 on the same layout: each device's gradient of each micro-batch is rounded.
    assert_same_training(bf16, trained(0, 4, 3, loss_fn=rounded_loss))
    # The master weights stay float64.
    assert {x.dtype for x in jax.tree.leaves(bf16[0].params)} == {np.dtype("float64")}


def test_bad_input_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"shards=3 must divide num_devices=4"):
        make(shards=3)
    with pytest.raises(ValueError, match=r"shards=1 must be None .* zero_stage=0 \(DDP\)"):
        jaxdp.Parallel(zero_stage=3, shards=1)
    for stage in (0, 1, 2):
        with pytest.raises(ValueError, match=rf"shards=2 needs zero_stage=3 .* zero_stage={stage}"):
            jaxdp.Parallel(zero_stage=stage, shards=2)
    with pytest.raises(ValueError, match=r"regather='window' needs zero_stage=3"):
        jaxdp.Parallel(zero_stage=2, regather="window")
    with pytest.raises(ValueError, match=r"regather='layer' must be 'micro_batch' or 'window'"):
        jaxdp.Parallel(zero_stage=3, regather="layer")
    with pytest.raises(ValueError, match=r"replica_all_reduce='after' must be 'per_layer' or"):
        jaxdp.Parallel(zero_stage=3, shards=2, replica_all_reduce="after")
    with pytest.raises(ValueError, match=r"replica_all_reduce='after_backward' needs HSDP"):
        jaxdp.Parallel(zero_stage=3, replica_all_reduce="after_backward")
    with pytest.raises(ValueError, match=r"regather='window' needs path='fused'"):
        make(path="multisteps", regather="window")
    # float8: accepted before issue 44, then a TypePromotionError at the first step.
    for dtype in ("bfloat17", "int8", "float8_e4m3fn"):
        with pytest.raises(
            ValueError,
            match=rf"gather_dtype='{dtype}' must be None .* or one of \('bfloat16', 'float16', "
            r"'float32', 'float64'\): the forward computes on the gathered weights",
        ):
            jaxdp.Parallel(zero_stage=3, gather_dtype=dtype)


def test_a_multisteps_state_of_another_layout_is_refused_naming_both():
    """Issue 44, item 7: a multisteps window's sums lie per device (stages 0, 1), split
    (2, 3) or per replica group (HSDP); given to a multisteps step of another layout they
    failed inside shard_map ("not evenly divisible", a failed reshape). The fused path's
    state has no window: any layout is taken (test_checkpoint's resumes move a window)."""
    batch = batches()[0]
    sizes = jaxdp.batch_sizes(num_devices=4, accum_steps=3, global_batch_size=len(batch[0]))
    call = jaxdp.micro_batches(batch, sizes)[0]
    for built, given, said in [
        (
            dict(shards=2),
            dict(zero_stage=0),
            r"state.window.grads\['blocks'\]\['b'\] has shape \(2, 3, 8\), the sums per "
            r"replica group, 2 groups \(HSDP, shards=2\); this step \(zero_stage=0\) keeps "
            r"them per device \(zero_stage 0 or 1\), shape \(4, 3, 8\)",
        ),
        (
            dict(),
            dict(shards=2),
            r"\['blocks'\]\['b'\] has shape \(3, 8\), the sums split over the devices "
            r"\(zero_stage 2 or 3\); this step \(zero_stage=3, shards=2\) keeps them per "
            r"replica group, 2 groups \(HSDP, shards=2\), shape \(2, 3, 8\)",
        ),
    ]:
        state = make(path="multisteps", **built).init(stacked_params())
        with pytest.raises(ValueError, match=said + ". The state was built by a multisteps"):
            make(path="multisteps", **given)(state, call)


class OnProcess:
    """A device as another process would see it: the mesh check reads ``process_index``
    (a real multi-process mesh needs processes: tests/test_distributed.py)."""

    def __init__(self, device, process_index):
        self.id, self.platform, self.process_index = device.id, device.platform, process_index


def test_a_shard_group_spanning_two_processes_is_refused():
    devices = [OnProcess(d, p) for d, p in zip(jax.devices()[:4], [0, 1, 0, 1], strict=True)]
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    with pytest.raises(ValueError, match=r"shard group's devices must belong to one process"):
        jaxdp.make_train_step(
            loss, optimizer(), mesh=mesh, parallel=jaxdp.Parallel(zero_stage=3, shards=2)
        )
    # Groups {0, 1} and {2, 3} each on one process: accepted.
    devices = [OnProcess(d, p) for d, p in zip(jax.devices()[:4], [0, 0, 1, 1], strict=True)]
    options = StepOptions(
        loss_fn=loss,
        optimizer=optimizer(),
        mesh=jax.sharding.Mesh(np.array(devices), ("data",)),
        parallel=jaxdp.Parallel(zero_stage=3, shards=2),
    )
    assert options.device_mesh.axis_names == ("replica", "data")
    assert options.device_mesh.devices.shape == (2, 2)
    # shards=N is plain stage 3: one group of every device, over processes as stage 3 is
    # (the check read the one-axis mesh's devices as groups: a TypeError on every rank).
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    options = StepOptions(
        loss_fn=loss,
        optimizer=optimizer(),
        mesh=mesh,
        parallel=jaxdp.Parallel(zero_stage=3, shards=4),
    )
    assert options.device_mesh.axis_names == ("data",)

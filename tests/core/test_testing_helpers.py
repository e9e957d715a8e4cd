"""jaxdp.testing's helpers: each passes what it should and fails, saying why, what it should."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxdp
from jaxdp.testing import (
    TARGETS,
    TOLERANCES,
    Buckets,
    Instruction,
    Tolerance,
    assert_collectives,
    assert_trees_close,
    collectives,
    format_report,
    gpu_mesh,
    instructions,
)

# ---- assert_trees_close ------------------------------------------------------------------


def test_every_tolerance_says_why():
    assert set(TOLERANCES) == {"float64", "float32", "bfloat16", "float16", "exact"}
    assert all(isinstance(t, Tolerance) and len(t.why) > 20 for t in TOLERANCES.values())


def test_close_trees_pass_within_their_dtypes_tolerance():
    tree = {"w": np.ones(3, np.float32), "n": np.arange(2), "b": [np.float64(2.0)]}
    near = {"w": tree["w"] * (1 + 1e-6), "n": np.arange(2), "b": [np.float64(2.0 + 1e-13)]}
    assert_trees_close(near, tree)


def test_a_leaf_out_of_tolerance_is_named_with_its_tolerance_and_why():
    expected = {"layer": {"w": np.ones(3, np.float32)}}
    actual = {"layer": {"w": np.array([1.0, 1.0, 1.0 + 1e-4], np.float32)}}
    with pytest.raises(AssertionError) as raised:
        assert_trees_close(actual, expected)
    text = str(raised.value)
    assert "['layer']['w'] (float32: rtol=1.3e-06, atol=1e-05, PyTorch's" in text
    assert "Mismatched elements: 1 / 3" in text


def test_the_less_precise_dtype_decides():
    # float32 against a float64 reference: compared at float32's tolerance.
    assert_trees_close(np.float32(1 + 1e-6), np.float64(1.0))
    with pytest.raises(AssertionError, match="float64: rtol=1e-12"):
        assert_trees_close(np.float64(1 + 1e-6), np.float64(1.0))
    assert_trees_close(jnp.bfloat16(1.01), jnp.bfloat16(1.0))


def test_integers_are_exact_and_an_explicit_tolerance_replaces_the_named_one():
    with pytest.raises(AssertionError, match=r"\[1\] \(exact: rtol=0, atol=0"):
        assert_trees_close([0, np.int32(3)], [0, np.int32(4)])
    assert_trees_close(np.float32(1.5), np.float32(1.0), rtol=0.5)
    with pytest.raises(AssertionError, match=r"float32: rtol=0.1, atol=1e-05\)"):
        assert_trees_close(np.float32(1.5), np.float32(1.0), rtol=0.1)


def test_structure_and_shape_must_match():
    with pytest.raises(AssertionError, match="the trees differ in structure"):
        assert_trees_close({"a": 1.0}, {"b": 1.0})
    # numpy would broadcast (3,) against (1,) and pass.
    with pytest.raises(AssertionError, match=r"\['a'\]: shape \(3,\) != expected \(1,\)"):
        assert_trees_close({"a": np.ones(3)}, {"a": np.ones(1)})


# ---- assert_collectives ------------------------------------------------------------------


def summed(body, *, varying=False):
    """A program over 4 devices whose per-device part is ``body`` (x has one row each);
    its result is one value (``varying``: one per device)."""
    mesh = jaxdp.data_mesh(4)
    out = P("data") if varying else P()
    mapped = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=out)
    return jax.jit(mapped).lower(jnp.ones((4, 3))).compile()


def test_one_all_reduce_per_call_passes_and_two_fail_with_the_table():
    compiled = summed(lambda x: jax.lax.psum(x, "data"))
    assert_collectives(compiled, all_reduce=1)
    assert_collectives(compiled.as_text(), all_reduce=1, all_gather=None)
    with pytest.raises(AssertionError, match=r"all_reduce=2: found 1 per call\ncollective"):
        assert_collectives(compiled, all_reduce=2)


def test_executions_count_loop_trips_and_unnamed_kinds_must_not_run():
    def body(x):
        return jax.lax.scan(lambda c, _: (c + jax.lax.psum(c, "data"), None), x, length=4)[0]

    compiled = summed(body, varying=True)
    assert_collectives(compiled, all_reduce=4)
    with pytest.raises(AssertionError, match=r"all_reduce=0: found 4 per call"):
        assert_collectives(compiled)


def test_a_collective_in_a_branch_has_no_one_count():
    def body(x):
        return jax.lax.cond(x.sum() > 0, lambda y: y + jax.lax.psum(y, "data"), lambda y: y, x)

    with pytest.raises(AssertionError, match=r"all_reduce=1: found 0..1 per call \(a branch"):
        assert_collectives(summed(body, varying=True), all_reduce=1)


def test_a_bad_expected_count_is_refused_by_name():
    with pytest.raises(ValueError, match=r"all_gather=-1 must be a non-negative integer, Buckets"):
        assert_collectives(summed(lambda x: jax.lax.psum(x, "data")), all_gather=-1)


# ---- asynchronous collectives and buckets ----------------------------------------------------

# A scheduled program as XLA:GPU prints it (trimmed): two gradient buckets, the first
# started before a GEMM fusion and done after it, the second started after the last one.
ASYNC = """HloModule jit_step, is_scheduled=true

%a (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%gemm_computation (p0: f32[64,64], p1: f32[64,64]) -> f32[64,64] {
  %p0 = f32[64,64]{1,0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  ROOT %dot = f32[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[64,64], g: f32[1024]) -> (f32[64,64], f32[1024], f32[256]) {
  %x = f32[64,64]{1,0} parameter(0)
  %g = f32[1024]{0} parameter(1)
  %ar = ((f32[1024]{0}), f32[1024]{0}) all-reduce-start(%g), replica_groups=[1,8]<=[8], to_apply=%a
  %gemm_fusion_dot = f32[64,64]{1,0} fusion(%x, %x), kind=kCustom, calls=%gemm_computation
  %ar-done = f32[1024]{0} all-reduce-done(%ar)
  %rs = ((f32[2048]), f32[256]{0}) reduce-scatter-start(%g), replica_groups=[1,8]<=[8], to_apply=%a
  %rs-done = f32[256]{0} reduce-scatter-done(%rs)
  ROOT %o = (f32[64,64]{1,0}, f32[1024]{0}, f32[256]{0}) tuple(%gemm_fusion_dot, %ar-done, %rs-done)
}
"""


def test_an_asynchronous_collective_counts_its_result_and_the_products_under_it():
    reduce, scatter = collectives(ASYNC)
    assert (reduce.kind, reduce.bytes, reduce.asynchronous) == ("all-reduce", 4096, True)
    assert reduce.products_under == ("gemm_fusion_dot",) and reduce.overlapped
    # A reduce-scatter's bytes are its whole buffer: each device's block times 8.
    assert (scatter.kind, scatter.bytes, scatter.products_under) == ("reduce-scatter", 8192, ())
    assert "products under" in format_report([reduce, scatter])


# XLA:GPU's collective fusion (trimmed): a bucket smaller than a leaf, the leaf's
# all-reduce run by a Triton kernel in a fusion, started before a GEMM and done after it.
COLLECTIVE_FUSION = """HloModule jit_step, is_scheduled=true

%a (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%gemm_computation (p0: f32[64,64], p1: f32[64,64]) -> f32[64,64] {
  %p0 = f32[64,64]{1,0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  ROOT %dot = f32[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_psum (param_0: f32[262144]) -> f32[262144] {
  %param_0 = f32[262144]{0} parameter(0)
  ROOT %psum.2 = f32[262144]{0} all-reduce(%param_0), replica_groups=[1,8]<=[8], to_apply=%a
}

ENTRY %main (x: f32[64,64], g: f32[262144]) -> (f32[64,64], f32[262144]) {
  %x = f32[64,64]{1,0} parameter(0)
  %g = f32[262144]{0} parameter(1)
  %fusion-start = ((f32[262144]{0}), f32[262144]{0}) fusion-start(%g), calls=%fused_psum
  %gemm_fusion_dot = f32[64,64]{1,0} fusion(%x, %x), kind=kCustom, calls=%gemm_computation
  %fusion-done = f32[262144]{0} fusion-done(%fusion-start)
  ROOT %o = (f32[64,64]{1,0}, f32[262144]{0}) tuple(%gemm_fusion_dot, %fusion-done)
}
"""


def test_a_collective_in_a_collective_fusion_counts_in_flight_between_its_start_and_done():
    (found,) = collectives(COLLECTIVE_FUSION)
    assert (found.kind, found.name, found.bytes) == ("all-reduce", "psum.2", 2**20)
    assert found.devices == 8
    assert found.asynchronous and found.products_under == ("gemm_fusion_dot",)
    assert_collectives(COLLECTIVE_FUSION, all_reduce=Buckets(2**20, extra=0, hidden=1.0))
    with pytest.raises(AssertionError, match="all_reduce=0: found 1 per call"):
        assert_collectives(COLLECTIVE_FUSION)


def test_a_dot_counts_its_flops_where_it_sits():
    """The GEMM fusion's dot: 64 x 64 outputs, each a sum over 64 products: 2 x 64^3."""
    (dot,) = [i for i in instructions(ASYNC) if i.flops]
    assert isinstance(dot, Instruction) and (dot.opcode, dot.fused_in) == ("dot", "gemm_fusion_dot")
    assert dot.flops == 2 * 64**3 and dot.context == ()


def test_buckets_assert_the_bytes_and_the_share_hidden():
    assert_collectives(ASYNC, all_reduce=Buckets(4096, hidden=1.0), reduce_scatter=1)
    assert_collectives(ASYNC, reduce_scatter=Buckets(8192, extra=0), all_reduce=None)
    with pytest.raises(AssertionError, match=r"carry 8,192 bytes per call, not 4,096"):
        assert_collectives(ASYNC, reduce_scatter=Buckets(4096, extra=0), all_reduce=None)
    # The reduce-scatter has nothing under it: 0% hidden, unless it is left out.
    with pytest.raises(AssertionError, match=r"0.0% of its bytes .* not at least 50%"):
        assert_collectives(ASYNC, reduce_scatter=Buckets(8192, hidden=0.5), all_reduce=None)
    assert_collectives(
        ASYNC,
        reduce_scatter=Buckets(8192, hidden=0.5, exposed=lambda c: c.bytes == 8192),
        all_reduce=None,
    )


def test_on_a_cpu_mesh_the_step_sends_its_gradients_in_one_synchronous_all_reduce():
    """XLA:CPU runs collectives synchronously: the window's gradients (8 x 3 weights, 3
    biases, float64) and its loss and weight sums travel in one all-reduce after the
    micro-batch loop, nothing under it."""
    compiled = zero_step(0)
    (found,) = collectives(compiled)
    assert not found.asynchronous and not found.in_loop
    assert_collectives(compiled, all_reduce=Buckets(27 * 8, extra=16))
    with pytest.raises(AssertionError, match="have a matrix product scheduled under them"):
        assert_collectives(compiled, all_reduce=Buckets(27 * 8, extra=16, hidden=0.5))


def test_a_gpu_mesh_refuses_what_it_cannot_describe():
    with pytest.raises(ValueError, match=r"topology='8' must be '<slices>x<hosts per slice>"):
        gpu_mesh("8")
    with pytest.raises(ValueError, match=r"target='a100' must be one of \('h100-sxm', 'h100'\)"):
        gpu_mesh(target="a100")
    assert TARGETS == ("h100-sxm", "h100")


def zero_step(stage, *, path="fused", accum_steps=2):
    """A ZeRO step on 4 devices of a linear model whose weight splits (8 rows of 4) and
    whose bias stays whole (its 3 values do not divide by 4), with the call's batch."""
    step = jaxdp.make_train_step(
        lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2),
        optax.adamw(1e-2),
        mesh=jaxdp.data_mesh(4),
        accum_steps=accum_steps,
        path=path,
        parallel=jaxdp.Parallel(zero_stage=stage),
    )
    state = step.init({"w": jnp.zeros((8, 3)), "b": jnp.zeros(3)})
    rows = 4 * 2 * (accum_steps if path == "fused" else 1)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(rows, 8)), "y": rng.normal(size=(rows, 3))}
    return step.compile(state, batch)


def test_zero_1_is_one_reduce_scatter_and_one_all_gather_per_applied_step():
    """README: ``Parallel(zero_stage=1)`` sends one reduce-scatter and one all-gather per
    step. The all-gather of the updated shards sits in the update's branch: a step skipped
    for non-finite gradients gathers nothing. The all-reduces (the whole bias, the loss and
    weight sums, the norm's scalars) are left to test_zero.py's byte counts."""
    compiled = zero_step(1, accum_steps=2)
    assert_collectives(compiled, reduce_scatter=1, all_gather=1, all_reduce=None, branch="applied")
    assert_collectives(compiled, reduce_scatter=1, all_gather=0, all_reduce=None, branch="skipped")
    with pytest.raises(AssertionError, match=r"all_gather=1: found 0..1 per call \(a branch or"):
        assert_collectives(compiled, reduce_scatter=1, all_gather=1, all_reduce=None)
    with pytest.raises(AssertionError, match=r"all_gather=1: found 0 per call \(calls that take"):
        assert_collectives(
            compiled, reduce_scatter=1, all_gather=1, all_reduce=None, branch="skipped"
        )


def test_zero_2_reduce_scatters_every_micro_batch_and_gathers_once_per_applied_step():
    """README: ``2`` shards the accumulator too: a reduce-scatter per micro-batch."""
    compiled = zero_step(2, accum_steps=3)
    expected = {"reduce_scatter": 3, "all_reduce": None}
    assert_collectives(compiled, all_gather=1, **expected, branch="applied")
    assert_collectives(compiled, all_gather=0, **expected, branch="skipped")


def test_a_multisteps_call_inside_a_window_communicates_nothing_at_stage_1():
    compiled = zero_step(1, path="multisteps", accum_steps=3)
    assert_collectives(compiled, reduce_scatter=1, all_gather=1, all_reduce=None, branch="applied")
    assert_collectives(compiled, branch="skipped")


def test_branch_must_be_applied_skipped_or_none_and_a_switch_has_neither():
    compiled = summed(lambda x: jax.lax.psum(x, "data"))
    with pytest.raises(ValueError, match=r"branch='taken' must be 'applied', 'skipped' or None"):
        assert_collectives(compiled, all_reduce=1, branch="taken")

    def body(x):
        ways = [lambda y: y, lambda y: y + jax.lax.psum(y, "data"), lambda y: 2 * y]
        return jax.lax.switch(jnp.int32(x.sum() > 0), ways, x)

    with pytest.raises(ValueError, match=r"conditional \S+ has more than two branches"):
        assert_collectives(summed(body, varying=True), all_reduce=1, branch="applied")


# XLA's predicated form of a two-way conditional: the true branch printed first.
PREDICATED = """HloModule m

%gather (a: f32[1]) -> f32[4] {
  %a = f32[1]{0} parameter(0)
  ROOT %g = f32[4]{0} all-gather(f32[1]{0} %a), replica_groups={{0,1,2,3}}, dimensions={0}
}

%keep (b: f32[1]) -> f32[4] {
  %b = f32[1]{0} parameter(0)
  ROOT %k = f32[4]{0} broadcast(f32[1]{0} %b), dimensions={0}
}

ENTRY %main (p: pred[], x: f32[1]) -> f32[4] {
  %p = pred[] parameter(0)
  %x = f32[1]{0} parameter(1)
  ROOT %c = f32[4]{0} conditional(pred[] %p, f32[1]{0} %x, f32[1]{0} %x), BRANCHES
}
""".replace("BRANCHES", "true_computation=%gather, false_computation=%keep")


def test_the_predicated_form_counts_its_true_branch_as_applied():
    assert_collectives(PREDICATED, all_gather=1, branch="applied")
    assert_collectives(PREDICATED, all_gather=0, branch="skipped")

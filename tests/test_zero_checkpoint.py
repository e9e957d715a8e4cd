"""Checkpoints of the state split over the mesh (ZeRO stages 1 to 3, HSDP): every process
writes its shards, and a resume on another device count, stage or shard group re-shards
them."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from models import big_batch_reference, mlp_params, mse_loss, regression_data, unpadded

import jaxdp
from jaxdp.testing import TOLERANCES, assert_trees_close

GLOBAL_BATCH, STEPS = 24, 3


def adamw_clip():
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=1e-2))


def make(stage, num_devices, accum_steps):
    step = jaxdp.make_train_step(
        mse_loss,
        adamw_clip(),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        parallel=jaxdp.Parallel(zero_stage=stage),
    )
    sizes = jaxdp.batch_sizes(
        num_devices=num_devices, accum_steps=accum_steps, global_batch_size=GLOBAL_BATCH
    )
    return step, sizes


def test_a_split_state_resumes_on_another_device_count_and_stage(tmp_path):
    """Saved after 2 steps on 4 devices at stage 1 (each leaf split along its first
    dimension that 4 divides, b1's 3 elements whole); resumed on 2 devices at stage 1,
    on 4 at stage 2 and on 2 at stage 0 (the leaves keep their shapes, only where they
    lie changes), the third step ends where one big batch does (float64, RTOL 1e-12: a
    lost or misplaced moment moves the weights by 1e-3 or more)."""
    x, y = regression_data(GLOBAL_BATCH * STEPS)
    batches = [(x[i::STEPS], y[i::STEPS]) for i in range(STEPS)]
    expected = big_batch_reference(mse_loss, adamw_clip(), mlp_params(), batches)
    step, sizes = make(1, 4, 2)
    state = step.init(mlp_params())
    for batch in batches[:2]:
        state, _ = step(state, batch)
    checkpoints = jaxdp.checkpoint.Checkpoints(tmp_path / "ckpt")
    position = jaxdp.SamplerPosition(0, 2, 0)
    checkpoints.save(state, position=position, sizes=sizes, samples=2 * GLOBAL_BATCH)
    assert (tmp_path / "ckpt" / "2" / "shards").is_dir()
    for stage, num_devices, accum_steps in [(1, 2, 3), (2, 4, 2), (0, 2, 3)]:
        step, sizes = make(stage, num_devices, accum_steps)
        restored = checkpoints.restore(step.init(mlp_params()), sizes=sizes)
        mu = restored.state.opt_state[1][0].mu["w0"]
        block = (8 // num_devices, 16) if stage else (8, 16)
        assert mu.shape == (8, 16) and mu.addressable_shards[0].data.shape == block
        state, _ = step(restored.state, batches[2])
        assert_trees_close(
            state.params, expected, rtol=TOLERANCES["float64"].rtol, atol=TOLERANCES["float64"].atol
        )


# ---- stage 3 and HSDP: the parameters split too ---------------------------------------

IN, WIDTH, OUT = 6, 8, 3


def stacked_params():
    """An embedding, two residual blocks stacked on a leading layer axis (for
    ``jaxdp.scan_layers``) and a head. On 4 devices at stage 3 ``embed/w`` and the
    blocks split along their last dimension and the head, which 4 does not divide, rests
    padded (its 3 columns to 4, zeros; checkpoints hold it in its own shape); at stage 2
    ``head/w`` splits along its first, so leaves change between split and whole too."""
    rng = np.random.default_rng(0)
    return {
        "embed": {"w": rng.normal(size=(IN, WIDTH), scale=0.4)},
        "blocks": {
            "w": rng.normal(size=(2, WIDTH, WIDTH), scale=0.3),
            "b": rng.normal(size=(2, WIDTH), scale=0.1),
        },
        "head": {"w": rng.normal(size=(WIDTH, OUT), scale=0.3), "b": rng.normal(size=OUT)},
    }


def stacked_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["embed"]["w"])
    h = jaxdp.scan_layers(
        lambda layer, h: h + jnp.tanh(h @ layer["w"] + layer["b"]), params["blocks"], h
    )
    return jnp.mean((h @ params["head"]["w"] + params["head"]["b"] - y) ** 2)


def stacked_batches(steps):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(GLOBAL_BATCH * steps, IN)), rng.normal(size=(GLOBAL_BATCH * steps, OUT))
    return [(x[i::steps], y[i::steps]) for i in range(steps)]


@jax.jit  # one program: run eagerly, the loss's small operations cost seconds
def one_device_update(params, opt_state, batch):
    updates, opt_state = adamw_clip().update(
        jax.grad(stacked_loss)(params, batch), opt_state, params
    )
    return optax.apply_updates(params, updates), opt_state


def one_device_params(batches):
    """Plain optax on one device: the parameters after each whole batch."""
    params, out = jax.tree.map(jnp.asarray, stacked_params()), []
    opt_state = adamw_clip().init(params)
    for batch in batches:
        params, opt_state = one_device_update(params, opt_state, batch)
        out.append(params)
    return out


@functools.cache  # one compiled step per layout
def make_split(stage, num_devices, shards=None, path="fused", accum_steps=2):
    step = jaxdp.make_train_step(
        stacked_loss,
        adamw_clip(),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        path=path,
        parallel=jaxdp.Parallel(zero_stage=stage, shards=shards, layers=("blocks",)),
    )
    sizes = jaxdp.batch_sizes(
        num_devices=num_devices, accum_steps=accum_steps, global_batch_size=GLOBAL_BATCH
    )
    return step, sizes


def block_shape(x):
    return x.addressable_shards[0].data.shape


def assert_same_bits(actual, expected, own=None):
    """Bit for bit; with ``own`` (the model's shapes, a tree like both) each side in them
    first, where a stage-3 layout holds a leaf padded (its padding asserted zero)."""
    if own is not None:
        actual, expected = unpadded(actual, own), unpadded(expected, own)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path)
        )


# Each layout trains one step, is saved, and the next restores it: stage 0 -> 3, 3 -> 3
# (the same layout: bitwise), 3 -> 2, 2 -> 3 on another device count, FSDP on 2 ->
# HSDP 2 x 2, HSDP -> FSDP on 4, 3 -> 0 (its step compiled for the first link).
# (stage, num_devices, shards) of each link.
CHAIN = [
    (0, 4, None),
    (3, 4, None),
    (3, 4, None),
    (2, 4, None),
    (3, 2, None),
    (3, 4, 2),
    (3, 4, None),
    (0, 4, None),
]


def test_a_stage_3_state_resumes_at_other_stages_device_counts_and_shards(tmp_path):
    """Every link continues where one device's plain optax is after the same batches
    (float64, RTOL 1e-12: a lost or misplaced block of a parameter or a moment moves
    the weights by 1e-3 or more), the restored leaves hold the saved values bit for
    bit in this run's layout, and where the layout is the saved one the next step is
    the uninterrupted run's, bit for bit."""
    batches = stacked_batches(len(CHAIN))
    expected = one_device_params(batches)
    checkpoints = jaxdp.checkpoint.Checkpoints(tmp_path / "ckpt")
    saved = saved_layout = None
    for s, layout in enumerate(CHAIN):
        stage, num_devices, shards = layout
        step, sizes = make_split(stage, num_devices, shards)
        state = step.init(stacked_params())
        if saved is not None:
            state = checkpoints.restore(state, sizes=sizes).state
            # In the model's shapes: the head (8 x 3) rests padded at stage 3 on 4 devices.
            own = jax.tree.map(jnp.asarray, stacked_params())
            assert_same_bits(state.params, saved.params, own)
            assert_same_bits(state.opt_state, saved.opt_state, adamw_clip().init(own))
        # The blocks split along their last dimension over a shard group at stage 3 only.
        blocks = (2, WIDTH, WIDTH // (shards or num_devices)) if stage == 3 else (2, WIDTH, WIDTH)
        assert block_shape(state.params["blocks"]["w"]) == blocks, layout
        if layout == saved_layout:
            uninterrupted, _ = step(saved, batches[s])
        state, _ = step(state, batches[s])
        if layout == saved_layout:
            assert_same_bits(state, uninterrupted)
        assert_trees_close(
            unpadded(state.params, expected[s]),
            expected[s],
            rtol=TOLERANCES["float64"].rtol,
            atol=TOLERANCES["float64"].atol,
        )
        checkpoints.save(
            state,
            position=jaxdp.SamplerPosition(0, s + 1, 0),
            sizes=sizes,
            samples=(s + 1) * GLOBAL_BATCH,
        )
        if layout == (3, 4, None):  # the checkpoint holds the model's shapes, and the stored
            meta = json.loads(
                (checkpoints.directory / str(int(state.step)) / "meta" / "metadata").read_text()
            )
            head = meta["leaves"]["params/head/w"]
            assert (head["shape"], head["stored"]) == ([WIDTH, 3], [WIDTH, 4]), head
        saved, saved_layout = state, layout


def test_an_hsdp_window_saved_mid_way_resumes_in_any_layout_of_its_batch(tmp_path):
    """HSDP 2 x 2, multisteps, K=2, saved after the first micro-batch of the second
    window: its gradient sums are each replica group's (2, *shape) for a split leaf,
    each device's (4, *shape) for a whole one. Resumed as it was, the window's last
    call is the uninterrupted one's, bit for bit. Resumed at FSDP (each split leaf's
    global sum) and at stage 0 (every leaf's per-device sums), and FSDP's window saved
    again and resumed at stage 0, the sums are re-laid out (their total kept) and the
    step ends where one device does (RTOL 1e-12: a dropped replica group's or device's
    sum moves the weights by 1e-3)."""
    batches = stacked_batches(2)
    expected = one_device_params(batches)[-1]
    step, sizes = make_split(3, 4, shards=2, path="multisteps")
    calls = [call for batch in batches for call in jaxdp.micro_batches(batch, sizes)]
    state = step.init(stacked_params())
    for call in calls[:3]:
        state, _ = step(state, call)
    assert block_shape(state.window.grads["blocks"]["w"]) == (1, 2, WIDTH, WIDTH // 2)
    checkpoints = jaxdp.checkpoint.Checkpoints(tmp_path / "ckpt")
    samples = GLOBAL_BATCH + sizes.num_devices * sizes.micro_batch_size
    position = jaxdp.SamplerPosition(0, 1, 1)
    checkpoints.save(state, position=position, sizes=sizes, samples=samples)
    uninterrupted, _ = step(state, calls[3])
    restored = checkpoints.restore(step.init(stacked_params()), sizes=sizes).state
    resumed, _ = step(restored, calls[3])
    assert_same_bits(resumed, uninterrupted)
    assert_trees_close(
        unpadded(resumed.params, expected),
        expected,
        rtol=TOLERANCES["float64"].rtol,
        atol=TOLERANCES["float64"].atol,
    )
    fsdp, stage_0 = (make_split(*layout, path="multisteps")[0] for layout in [(3, 4), (0, 4)])
    at_fsdp = checkpoints.restore(fsdp.init(stacked_params()), sizes=sizes).state
    assert block_shape(at_fsdp.window.grads["blocks"]["w"]) == (2, WIDTH, WIDTH // 4)
    again = jaxdp.checkpoint.Checkpoints(tmp_path / "fsdp")  # the global sums saved
    again.save(at_fsdp, position=position, sizes=sizes, samples=samples)
    for other, source in [(fsdp, checkpoints), (stage_0, checkpoints), (stage_0, again)]:
        restored = source.restore(other.init(stacked_params()), sizes=sizes).state
        assert int(restored.window.position) == 1
        resumed, _ = other(restored, calls[3])
        assert int(resumed.step) == 2
        assert_trees_close(
            unpadded(resumed.params, expected),
            expected,
            rtol=TOLERANCES["float64"].rtol,
            atol=TOLERANCES["float64"].atol,
        )

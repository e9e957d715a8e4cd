"""Checkpoints of the optimizer state split over the mesh (ZeRO): every process writes its
shards, and a resume on another device count re-shards them."""

import optax
from helpers import ATOL, RTOL, assert_trees_close
from models import big_batch_reference, mlp_params, mse_loss, regression_data

import jaxdp

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
        assert_trees_close(state.params, expected, rtol=RTOL["float64"], atol=ATOL["float64"])

"""Streamed sources through jaxdp.data.Loader (issue 51, item 3): a grain IterDataset and a
Hugging Face streaming IterableDataset, each process reading its own shard, every row once
per epoch by the stream's rule, and a checkpointed stop resumed bitwise; what a stream
without a saved state gets; what is refused.

The stream's rule: each call takes the next records of this process's shard in the
stream's order; an epoch is one pass, and ends at the first optimizer step for which
some process's shard has too few records left (that tail is dropped, on every process).
"""

import warnings

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jaxdp
import jaxdp.data
from jaxdp.checkpoint import CheckpointError, Checkpoints

# datasets is imported where it is used: every xdist worker collects this file, and the
# import costs about 2.7 CPU s.

N = 31  # two shards of 16 and 15 rows: the agreement between processes ends the epoch
# 4 devices (2 processes x 2), a step of 8 rows: 4 of each process's shard.
SIZES = jaxdp.batch_sizes(num_devices=4, accum_steps=2, micro_batch_size=1)
PER_PROCESS = 4


def columns():
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(N, 2)).astype(np.float32), "i": np.arange(N)}


def records():
    data = columns()
    return [{"x": data["x"][i], "i": data["i"][i]} for i in range(N)]


def grain_shard(process, count):
    """Shard ``process`` of a shuffled grain pipeline, as grain teaches it:
    ShardByJaxProcess's slice of the MapDataset, then to_iter_dataset()."""
    return (
        grain.MapDataset.source(records())
        .shuffle(seed=5)[process::count]
        .map(lambda r: {**r, "x": 2 * r["x"]})
    )


def grain_stream():
    shard = grain.sharding.ShardByJaxProcess()
    return grain_shard(shard.shard_index, shard.shard_count).to_iter_dataset()


def grain_rows(process):
    return [int(r["i"]) for r in grain_shard(process, 2)]


def hf_whole():
    import datasets

    return datasets.Dataset.from_dict(columns()).to_iterable_dataset(num_shards=2)


def hf_stream():
    """This process's node of a 2-shard stream (a shard, a file, per node)."""
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(
        hf_whole(), rank=jax.process_index(), world_size=jax.process_count()
    )


def hf_rows(process):
    from datasets.distributed import split_dataset_by_node

    return [int(r["i"]) for r in split_dataset_by_node(hf_whole(), rank=process, world_size=2)]


def loss(w, batch):
    return jnp.mean((batch["x"] @ w - batch["i"]) ** 2)


def train(make, path, mesh, *, checkpoints=None, stop_after=None, resume=False):
    """Two epochs through a Loader over ``make()``: every call's rows (all processes) and
    the final parameters; ``stop_after`` calls saves a checkpoint and stops there,
    ``resume`` restores from it first (a new loader, stream and state, as after a restart)."""
    from jax.experimental import multihost_utils

    loader = jaxdp.data.Loader(make(), SIZES, mesh=mesh, path=path, epochs=2)
    step = jaxdp.make_train_step(loss, optax.sgd(0.01), mesh=mesh, accum_steps=2, path=path)
    state = step.init(np.zeros(2))
    if resume:
        state = checkpoints.restore(state, data=loader).state
    rows = []
    for calls, batch in enumerate(loader, 1):
        state, _ = step(state, batch)
        rows.append(multihost_utils.process_allgather(batch.data["i"], tiled=True).tolist())
        if calls == stop_after:
            checkpoints.save(state, data=loader)
            break
    params = multihost_utils.process_allgather(state.params, tiled=True)
    return rows, np.asarray(params)


def check_streamed(make, shard_rows, path, directory):
    mesh = jaxdp.initialize()  # 2 processes x 2 devices
    rows, params = train(make, path, mesh)
    # Every row once per epoch by the rule: 3 steps (shard 1 holds 15 rows, 3 steps of 4),
    # each step 4 of each shard in order, process 0's first; the shards' tails dropped.
    calls = 3 * (1 if path == "fused" else 2)
    assert len(rows) == 2 * calls
    shards = [shard_rows(0), shard_rows(1)]
    for epoch in (0, 1):
        seen = sum(rows[epoch * calls : (epoch + 1) * calls], [])
        assert sorted(seen) == sorted(shards[0][:12] + shards[1][:12])
        assert len(set(seen)) == 24
    first_step = shards[0][:4] + shards[1][:4]
    assert sum(rows[: 1 if path == "fused" else 2], []) == (
        first_step
        if path == "fused"
        else shards[0][:2] + shards[1][:2] + shards[0][2:4] + shards[1][2:4]
    )
    # A stop after 4 calls (fused: in epoch 1; multisteps: mid-step 2), resumed on a new
    # loader and stream: the same calls, the same weights to the bit.
    checkpoints = Checkpoints(directory)
    before, _ = train(make, path, mesh, checkpoints=checkpoints, stop_after=4 - (path != "fused"))
    after, resumed = train(make, path, mesh, checkpoints=Checkpoints(directory), resume=True)
    assert before + after == rows
    np.testing.assert_array_equal(resumed, params)


@pytest.mark.devices(2, processes=2)
def test_a_grain_iter_dataset_on_two_processes_every_row_once_and_a_bitwise_resume(
    shared_tmp_path,
):
    check_streamed(grain_stream, grain_rows, "fused", shared_tmp_path / "ckpt")


@pytest.mark.devices(2, processes=2)
def test_a_hugging_face_stream_on_two_processes_every_row_once_and_a_bitwise_resume(
    shared_tmp_path,
):
    check_streamed(hf_stream, hf_rows, "multisteps", shared_tmp_path / "ckpt")


# ---- one process ----------------------------------------------------------------------

ONE = jaxdp.batch_sizes(num_devices=2, accum_steps=2, micro_batch_size=2)  # 8 rows a step


class Plain:
    """An iterable without a saved state (as a torch IterableDataset): starts over each pass."""

    def __iter__(self):
        return iter(records())


def ids(loader):
    return [np.asarray(b.data["i"]).tolist() for b in loader]


def test_a_stream_without_a_saved_state_resumes_by_reading_its_pass_again_with_a_warning():
    mesh = jaxdp.data_mesh(2)
    whole = ids(jaxdp.data.Loader(Plain(), ONE, mesh=mesh, path="multisteps", epochs=2))
    assert len(whole) == 2 * 3 * 2  # 31 rows: 3 steps of 8 per pass, 7 dropped
    stopped = jaxdp.data.Loader(Plain(), ONE, mesh=mesh, path="multisteps", epochs=2)
    iterator = iter(stopped)
    first = [np.asarray(next(iterator).data["i"]).tolist() for _ in range(9)]
    stopped.close()
    state = stopped.state()
    assert state["stream"] == "none" and state["stream_state"] == [None]
    again = jaxdp.data.Loader(Plain(), ONE, mesh=mesh, path="multisteps", epochs=2)
    with pytest.warns(RuntimeWarning, match=r"the Plain has no saved state .* discards the 12 rec"):
        again.restore(state)
    assert first + ids(again) == whole


def test_a_stream_refuses_the_loaders_own_order_options_iterators_and_torch_loaders():
    mesh = jaxdp.data_mesh(2)
    stream = grain.MapDataset.source(records()).to_iter_dataset()
    for option in ({"shuffle": True}, {"seed": 3}, {"drop_last": False}, {"last_window": "step"}):
        with pytest.raises(ValueError, match=f"{next(iter(option))}= is for a random-access sou"):
            jaxdp.data.Loader(stream, ONE, mesh=mesh, **option)
    with pytest.raises(TypeError, match=r"source is an iterator \(generator\): it is read once"):
        jaxdp.data.Loader((r for r in records()), ONE, mesh=mesh)
    loader = torch.utils.data.DataLoader(Plain(), batch_size=4)
    with pytest.raises(TypeError, match=r"torch DataLoader \(DataLoader\): it batches rows"):
        jaxdp.data.Loader(loader, ONE, mesh=mesh)
    short = grain.MapDataset.source(records()[:7]).to_iter_dataset()
    with pytest.raises(ValueError, match="epoch 0 of the PrefetchIterDataset gave no optimizer st"):
        ids(jaxdp.data.Loader(short, ONE, mesh=mesh))


def test_a_streams_position_restores_only_into_a_stream_of_its_kind_and_global_batch(tmp_path):
    mesh = jaxdp.data_mesh(2)
    step = jaxdp.make_train_step(loss, optax.sgd(0.01), mesh=mesh, accum_steps=2)
    streamed = jaxdp.data.Loader(hf_whole(), ONE, mesh=mesh)
    state, _ = step(step.init(np.zeros(2)), next(iter(streamed)))
    streamed.close()
    checkpoints = Checkpoints(tmp_path)
    checkpoints.save(state, data=streamed)
    arrays = jaxdp.data.Loader(columns(), ONE, mesh=mesh)
    with pytest.raises(CheckpointError, match=r"saved by a loader of a stream \(state_dict\); th"):
        checkpoints.restore(state, data=arrays)
    other = jaxdp.data.Loader(grain.MapDataset.source(records()).to_iter_dataset(), ONE, mesh=mesh)
    with pytest.raises(ValueError, match="saved with stream='state_dict'; this loader has stream="):
        other.restore(streamed.state())
    bigger = jaxdp.batch_sizes(num_devices=2, accum_steps=2, micro_batch_size=4)
    with pytest.raises(ValueError, match="force does not apply"):
        jaxdp.data.Loader(hf_whole(), bigger, mesh=mesh).restore(streamed.state(), force=True)
    with pytest.raises(ValueError, match="saved by a loader of a random-access source; this lo"):
        jaxdp.data.Loader(hf_whole(), ONE, mesh=mesh).restore(arrays.state())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stream with its own state re-reads nothing
        resumed = jaxdp.data.Loader(hf_whole(), ONE, mesh=mesh)
        checkpoints.restore(state, data=resumed)
    with resumed:
        assert np.asarray(next(iter(resumed)).data["i"]).tolist() == list(range(8, 16))

"""What the library says for inputs built for something else: a state from another mesh,
a loader's batch of another split or path, ZeRO without trainable parameters, and a read
that never returns (issue 23, item 8)."""

import threading

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
import jaxdp.data


def loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"]) ** 2)


def make_step(devices, path="fused", accum_steps=2, **kwargs):
    mesh = jaxdp.data_mesh(devices)
    return jaxdp.make_train_step(
        loss, optax.sgd(0.1), mesh=mesh, accum_steps=accum_steps, path=path, **kwargs
    )


def source(n=64):
    return {"x": np.arange(n * 3, dtype=np.float64).reshape(n, 3) / 100}


PARAMS = {"w": np.ones(3)}


def test_a_state_from_another_mesh_is_refused_naming_both_device_lists():
    four = make_step(4)
    state = make_step(2).init(PARAMS)
    batch = {"x": np.ones((8, 3))}
    with pytest.raises(
        ValueError,
        match=r"state is on devices \[0, 1\]; this step's mesh has "
        r"devices \[0, 1, 2, 3\]: the state was built by a step on another mesh",
    ):
        four(state, batch)
    state, _ = four(four.init(PARAMS), batch)  # its own state still trains
    assert int(state.step) == 1


@pytest.mark.parametrize(
    "loader_kwargs,message",
    [
        (dict(path="multisteps"), "path='multisteps'"),
        (dict(accum_steps=4), "accum_steps=4"),
        (dict(devices=2), "num_devices=2"),
    ],
)
def test_a_loaders_batch_for_another_split_or_path_is_refused_naming_both(loader_kwargs, message):
    step = make_step(4)
    devices = loader_kwargs.get("devices", 4)
    sizes = jaxdp.batch_sizes(
        num_devices=devices, accum_steps=loader_kwargs.get("accum_steps", 2), micro_batch_size=2
    )
    path = loader_kwargs.get("path", "fused")
    with jaxdp.data.Loader(source(), sizes, mesh=jaxdp.data_mesh(devices), path=path) as loader:
        batch = next(iter(loader))
    with pytest.raises(
        ValueError,
        match=f"the batch comes from a Loader with .*{message}.*; "
        "this step has path='fused', num_devices=4, accum_steps=2",
    ):
        step(step.init(PARAMS), batch)


def test_a_loaders_batch_of_the_steps_split_trains_as_data_and_weights_do():
    step = make_step(4, path="multisteps", donate=False)
    sizes = jaxdp.batch_sizes(num_devices=4, accum_steps=2, micro_batch_size=2)
    mesh = jaxdp.data_mesh(4)
    with jaxdp.data.Loader(source(), sizes, mesh=mesh, path="multisteps") as loader:
        batches = [b for _, b in zip(range(2), loader, strict=False)]
    whole = split = step.init(PARAMS)
    for batch in batches:
        whole, _ = step(whole, batch)
        split, _ = step(split, batch.data, batch.micro_weights)
    np.testing.assert_array_equal(whole.params["w"], split.params["w"])
    assert int(whole.step) == 1


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_without_trainable_parameters_is_refused_at_init(stage):
    step = make_step(2, parallel=jaxdp.Parallel(zero_stage=stage))
    with pytest.raises(
        ValueError,
        match=f"zero_stage={stage} splits the trainable parameters' "
        "optimizer state over the devices, and params has no trainable leaf "
        r"\(0 leaves in all\): use zero_stage=0",
    ):
        step.init({})


class Hanging:
    """Record 5 blocks until released: a read from a hung network file system."""

    def __init__(self):
        self.release = threading.Event()

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 5:
            self.release.wait()
        return {"x": np.full(3, float(i))}


def test_a_read_that_never_returns_raises_after_the_timeout_naming_the_record():
    hanging = Hanging()
    sizes = jaxdp.batch_sizes(num_devices=2, accum_steps=1, micro_batch_size=2)
    loader = jaxdp.data.Loader(
        hanging, sizes, mesh=jaxdp.data_mesh(2), shuffle=False, read_timeout_s=0.5, workers=1
    )
    seen = []
    try:
        with pytest.raises(
            jaxdp.data.LoaderTimeoutError,
            match=r"no batch after "
            r"read_timeout_s=0.5: the read of source record 5 has not returned",
        ):
            for batch in loader:
                seen.append(batch.position)
    finally:
        hanging.release.set()  # lets the worker thread end
        loader.close()
    assert seen == [(0, 1, 0)]  # rows 0 to 3 arrived; the call holding row 5 did not
    assert loader.position == (0, 1, 0)
    with pytest.raises(ValueError, match="read_timeout_s=0 must be a number > 0 or None"):
        jaxdp.data.Loader(hanging, sizes, mesh=jaxdp.data_mesh(2), read_timeout_s=0)

"""Issue 12: bad input never kills the process or trains silently wrong; every guard
names the argument, the rule and the values, before the step runs."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import mlp_params, mse_loss, regression_data

import jaxdp
from jaxdp import _train_state

NUM_DEVICES, ACCUM = 4, 2


def make(loss_fn=mse_loss, optimizer=None, **kwargs):
    options = {"mesh": jaxdp.data_mesh(NUM_DEVICES), "accum_steps": ACCUM} | kwargs
    return jaxdp.make_train_step(loss_fn, optimizer or optax.sgd(0.1), **options)


def rows(step, micro_batch_size=2):
    """Rows of one call: a global batch (fused) or a global micro-batch (multisteps)."""
    per_call = ACCUM if step.path == "fused" else 1
    return NUM_DEVICES * per_call * micro_batch_size


def weighted_loss(params, batch):
    x, y = batch
    return jnp.sum((x @ params["w"] - y) ** 2), -jnp.asarray(x.shape[0], x.dtype)


# ---- item 1: a donated state --------------------------------------------------------


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_a_donated_state_passed_again_raises_instead_of_crashing(path):
    step = make(path=path)
    state = step.init(mlp_params())
    batch = regression_data(rows(step))
    new, _ = step(state, batch)
    with pytest.raises(
        ValueError,
        match=r"state was donated to an earlier call: its buffers are deleted \(\d+ of \d+ "
        r"leaves\); pass the state the previous call returned, or build the step with "
        r"donate=False",
    ):
        step(state, batch)
    step(new, batch)  # the returned state is still good


def test_saving_a_donated_state_raises_before_writing(tmp_path):
    step = make()
    state = step.init(mlp_params())
    step(state, regression_data(rows(step)))
    checkpoints = jaxdp.checkpoint.Checkpoints(tmp_path / "ckpt")
    sizes = jaxdp.BatchSizes(NUM_DEVICES, ACCUM, 2, rows(step))
    with pytest.raises(ValueError, match=r"state was donated to an earlier call"):
        checkpoints.save(state, position=jaxdp.SamplerPosition(0, 1), sizes=sizes, samples=16)
    assert checkpoints.steps == []
    assert not any((tmp_path / "ckpt").iterdir())


def test_check_live_names_a_deleted_leaf_of_a_mixed_state():
    step = make()
    state = step.init(mlp_params())
    _train_state.check_live(state, "state")
    step(state, regression_data(16))
    fresh = jax.device_put(jnp.zeros([], jnp.int32))
    mixed = state._replace(step=fresh, skips=_train_state.SkipCounts(fresh, fresh))
    with pytest.raises(ValueError, match=r"state\.params\['b0'\] .* deleted"):
        _train_state.check_live(mixed, "state")


# ---- item 2: mistakes of the first hour ----------------------------------------------


def test_a_mean_loss_returning_a_tuple_names_the_mode():
    step = make(loss_fn=lambda p, b: (mse_loss(p, b), 1.0))
    with pytest.raises(
        TypeError,
        match=r"loss_fn returned a tuple of 2 values with loss_reduction='mean', which takes "
        r"one scalar .* loss_reduction='weighted'",
    ):
        step(step.init(mlp_params()), regression_data(16))


@pytest.mark.parametrize(("built", "used"), [("fused", "multisteps"), ("multisteps", "fused")])
def test_a_state_of_another_path_is_refused(built, used):
    state = make(path=built).init(mlp_params())
    step = make(path=used)
    with pytest.raises(
        ValueError,
        match=rf"state was built by a step with path='{built}'; this step has path='{used}'",
    ):
        step(state, regression_data(rows(step)))


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_a_state_of_another_optimizer_is_refused_naming_both_layouts(path):
    state = make(optimizer=optax.adamw(0.1), path=path).init(mlp_params())
    step = make(optimizer=optax.sgd(0.1, momentum=0.9), path=path)
    with pytest.raises(
        ValueError,
        match=r"state\.opt_state was built by another optimizer: it holds "
        r".*ScaleByAdamState.*; this step's optimizer keeps .*TraceState",
    ):
        step(state, regression_data(rows(step)))


def test_an_integer_parameter_is_named_and_can_be_frozen():
    params = mlp_params() | {"count": np.zeros(3, np.int32)}
    with pytest.raises(
        TypeError,
        match=r"params\['count'\] has dtype int32; every trainable parameter must be "
        r"floating-point .* trainable=",
    ):
        make().init(params)
    step = make(trainable=lambda path, value: path[0] != "count")
    state, _ = step(step.init(params), regression_data(16))
    assert state.params["count"].dtype == np.int32


@pytest.mark.parametrize(("leaf", "kind"), [(jnp.tanh, "PjitFunction|function"), ("relu", "str")])
def test_a_non_array_leaf_is_named_with_what_to_do(leaf, kind):
    with pytest.raises(
        TypeError,
        match=rf"params\['act'\] is a ({kind}) .* not an array.*Split static parts off.*"
        r"pass the model itself to step\.init",
    ):
        make().init(mlp_params() | {"act": leaf})


def test_data_mesh_takes_a_positive_integer():
    with pytest.raises(ValueError, match=r"num_devices=2\.5 must be a positive integer"):
        jaxdp.data_mesh(2.5)
    assert jaxdp.data_mesh(np.int64(2)).devices.size == 2


def test_a_mesh_that_is_a_list_is_refused():
    with pytest.raises(
        TypeError,
        match=r"mesh= must be a jax\.sharding\.Mesh with one axis, got a list of 2 devices; "
        r"build it with jaxdp\.data_mesh",
    ):
        jaxdp.make_train_step(mse_loss, optax.sgd(0.1), mesh=jax.devices()[:2])


def test_an_optimizer_factory_is_refused():
    with pytest.raises(
        TypeError,
        match=r"optimizer=<function sgd .*> is a function, not an optax\.GradientTransformation;"
        r" call it",
    ):
        jaxdp.make_train_step(mse_loss, optax.sgd, mesh=jaxdp.data_mesh(2))
    with pytest.raises(TypeError, match=r"loss_fn='mse' must be callable"):
        jaxdp.make_train_step("mse", optax.sgd(0.1), mesh=jaxdp.data_mesh(2))


@pytest.mark.parametrize(
    ("kwargs", "rule"),
    [
        ({"dataset_size": 2.5}, r"dataset_size=2\.5 must be a positive integer"),
        ({"num_replicas": 2.0}, r"num_replicas=2\.0 must be a positive integer"),
        ({"rank": 1.0}, r"rank=1\.0 must be an integer"),
        ({"seed": -1}, r"seed=-1 must be a non-negative integer"),
        ({"seed": 0.5}, r"seed=0\.5 must be a non-negative integer"),
    ],
)
def test_sampler_arguments_are_checked_at_construction(kwargs, rule):
    arguments = {"dataset_size": 10, "num_replicas": 2, "rank": 0} | kwargs
    with pytest.raises(ValueError, match=rule):
        jaxdp.DistributedSampler(**arguments)


def test_a_negative_epoch_is_refused_when_set():
    sampler = jaxdp.DistributedSampler(10, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match=r"epoch=-1 must be a non-negative integer"):
        sampler.set_epoch(-1)
    sizes = jaxdp.batch_sizes(num_devices=2, micro_batch_size=1)
    with pytest.raises(ValueError, match=r"epoch=-2 must be a non-negative integer"):
        jaxdp.epoch_schedule(10, sizes, epoch=-2)


def test_a_batch_of_python_lists_names_the_leaf():
    step = make()
    x, y = regression_data(16)
    with pytest.raises(
        TypeError, match=r"batch\[0\]\[0\]\[0\] is a float, not an array.*np\.asarray"
    ):
        step(step.init(mlp_params()), (x.tolist(), y.tolist()))
    with pytest.raises(ValueError, match=r"batch\[1\] has shape \(\); every batch leaf needs"):
        step.sizes((x, np.float64(1.0)))


# ---- item 4: negative weights and counts ---------------------------------------------


@pytest.mark.parametrize("weights", [[1.0, -1.0], [1.0, np.nan]])
def test_negative_or_nan_micro_weights_are_refused(weights):
    step = make()
    with pytest.raises(
        ValueError, match=r"micro_weights=\[1\.0, (-1\.0|nan)\] must be finite and at least 0"
    ):
        step(step.init(mlp_params()), regression_data(16), weights)


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_a_negative_count_is_never_applied(path):
    params = {"w": np.ones((8, 3))}
    step = make(loss_fn=weighted_loss, loss_reduction="weighted", path=path)
    state = step.init(params)
    for _ in range(ACCUM if path == "multisteps" else 1):
        state, metrics = step(state, regression_data(rows(step)))
    assert bool(metrics["skipped"]) and not bool(metrics["finite"])
    np.testing.assert_array_equal(state.params["w"], params["w"])


# ---- item 5: the batch identity of a window ------------------------------------------


def test_a_multisteps_window_keeps_its_micro_batch_size():
    step = make(path="multisteps")
    state, _ = step(step.init(mlp_params()), regression_data(rows(step, 2)))
    with pytest.raises(
        ValueError,
        match=r"micro_batch_size=1 .* the open accumulation window \(1 of accum_steps=2 "
        r"micro-batches\) started with micro_batch_size=2",
    ):
        step(state, regression_data(rows(step, 1)))
    state, metrics = step(state, regression_data(rows(step, 2)))  # the state is intact
    assert bool(metrics["emitted"])


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_a_new_micro_batch_size_is_announced_once(path):
    step = make(path=path)
    state = step.init(mlp_params())
    for _ in range(ACCUM):
        state, _ = step(state, regression_data(rows(step, 2)))
    with pytest.warns(UserWarning, match=r"micro_batch_size changed from 2 to 3 .* compiles"):
        state, _ = step(state, regression_data(rows(step, 3)))
    calls = 1 if path == "fused" else ACCUM  # per window
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        for size in [3] * (calls - 1) + [2] * calls:
            state, _ = step(state, regression_data(rows(step, size)))
    # The rest of the window at 3 and the change back to 2 between windows: no warning.
    assert [str(w.message) for w in later] == []
    # Optimizer steps: the first window(s) at 2, one at 3, one back at 2.
    assert int(state.step) == (ACCUM + 2 if path == "fused" else 3)


# ---- item 8: a NaN reported without skip_nonfinite ------------------------------------


@pytest.mark.parametrize("path", ["fused", "multisteps"])
@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_the_finite_metric_reports_a_nan_on_one_device(path, skip_nonfinite):
    step = make(path=path, skips=jaxdp.Skips(nonfinite=skip_nonfinite))
    state = step.init(mlp_params())
    x, y = regression_data(rows(step))
    bad = x.copy()
    bad[-1, 0] = np.nan  # one row of the last device
    finite = []
    for batch in [(x, y)] * ACCUM + [(bad, y)] * ACCUM:
        state, metrics = step(state, batch)
        if path == "fused" or bool(metrics["emitted"]):
            finite.append(bool(metrics["finite"]))
    assert finite[:1] == [True] and finite[-1] is False
    assert np.isnan(np.asarray(state.params["w0"])).any() == (not skip_nonfinite)

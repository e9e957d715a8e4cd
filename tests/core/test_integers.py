"""Integer arguments are checked alike everywhere in the public API (issue 31, item 7): a
Python or numpy integer is an integer (``np.int64(2)``, what numpy arithmetic and
config files give), a bool is not (``accum_steps=True`` is a mistake, not 1), and the
error names the argument and its value."""

import numpy as np
import optax
import pytest
from models import mlp_params, mse_loss, regression_data

import jaxdp
import jaxdp.checkpoint
import jaxdp.data
import jaxdp.plan


def mesh():
    return jaxdp.data_mesh(4)


def sizes(**kwargs):
    return jaxdp.batch_sizes(
        **({"num_devices": 4, "accum_steps": 2, "micro_batch_size": 3} | kwargs)
    )


def make(**kwargs):
    return jaxdp.make_train_step(mse_loss, optax.sgd(0.1), mesh=mesh(), **kwargs)


def loader(**kwargs):
    x = np.zeros((48, 3), np.float32)
    return jaxdp.data.Loader({"x": x}, sizes(), mesh=mesh(), **kwargs)


def launch_check(**kwargs):
    from jaxdp.cli._launch import _check

    options = dict(nprocs=2, devices_per_process=None, grace_s=1.0, timeout_s=None)
    options |= dict(heartbeat_timeout_s=None, max_restarts=0, hang_timeout_s=None)
    _check(**(options | kwargs))


# (what is called with the value, the argument's name): every integer argument of the
# public API whose check is jaxdp's own.
TAKERS = {
    "make_train_step(accum_steps)": (lambda v: make(accum_steps=v), "accum_steps"),
    "make_train_step(rng_seed)": (lambda v: make(rng_seed=v), "rng_seed"),
    "Parallel(zero_stage)": (lambda v: jaxdp.Parallel(zero_stage=v), "zero_stage"),
    "Skips(max_consecutive)": (
        lambda v: jaxdp.Skips(max_consecutive=v),
        "max_consecutive_skips",
    ),
    "SkipWatch(limit)": (lambda v: jaxdp.SkipWatch(v, bound=False), "limit"),
    "batch_sizes(num_devices)": (lambda v: sizes(num_devices=v), "num_devices"),
    "batch_sizes(accum_steps)": (lambda v: sizes(accum_steps=v), "accum_steps"),
    "batch_sizes(micro_batch_size)": (lambda v: sizes(micro_batch_size=v), "micro_batch_size"),
    "batch_sizes(global_batch_size)": (
        lambda v: jaxdp.batch_sizes(num_devices=1, accum_steps=1, global_batch_size=v),
        "global_batch_size",
    ),
    "data_mesh(num_devices)": (lambda v: jaxdp.data_mesh(v), "num_devices"),
    "emulate_cpu_devices(num_devices)": (
        # np.int64(2) asks for 8, the count the backend has (a no-op then)
        lambda v: jaxdp.emulate_cpu_devices(v if isinstance(v, bool) else 4 * v),
        "num_devices",
    ),
    "DistributedSampler(num_replicas)": (
        lambda v: jaxdp.DistributedSampler(10, num_replicas=v, rank=0),
        "num_replicas",
    ),
    "epoch_schedule(seed)": (lambda v: jaxdp.epoch_schedule(48, sizes(), seed=v), "seed"),
    "resume_position(steps_per_epoch)": (
        lambda v: jaxdp.resume_position(
            jaxdp.SamplerPosition(0, 1, 0), saved=sizes(), sizes=sizes(), steps_per_epoch=v
        ),
        "steps_per_epoch",
    ),
    "Loader(seed)": (lambda v: loader(seed=v).close(), "seed"),
    "Loader(workers)": (lambda v: loader(workers=v).close(), "workers"),
    "plan_memory(num_devices)": (
        lambda v: jaxdp.plan.plan_memory(params=1000, num_devices=v),
        "num_devices",
    ),
    "plan_memory(zero_stage)": (
        lambda v: jaxdp.plan.plan_memory(params=1000, num_devices=2, zero_stage=v),
        "zero_stage",
    ),
    "launch(nprocs)": (lambda v: launch_check(nprocs=v), "nprocs"),
    "launch(max_restarts)": (lambda v: launch_check(max_restarts=v), "max_restarts"),
}


@pytest.mark.parametrize("taker", TAKERS)
def test_a_bool_is_refused_naming_the_argument(taker):
    call, name = TAKERS[taker]
    with pytest.raises(ValueError, match=rf"{name}=True must be"):
        call(True)


@pytest.mark.parametrize("taker", TAKERS)
def test_a_numpy_integer_is_taken(taker):
    call, _ = TAKERS[taker]
    built, plain = call(np.int64(2)), call(2)  # the first raises if refused
    # What it builds holds the integer as a plain int: its value reads as the int's does
    # (a repr showing np.int64(2) would differ); objects whose repr is their address aside.
    assert type(built) is type(plain)
    if " at 0x" not in repr(plain):
        assert repr(built) == repr(plain)


def test_checkpoints_keep_takes_a_numpy_integer_and_refuses_a_bool(tmp_path):
    with pytest.raises(ValueError, match="keep=True must be a positive integer"):
        jaxdp.checkpoint.Checkpoints(tmp_path / "a", keep=True)
    assert jaxdp.checkpoint.Checkpoints(tmp_path / "b", keep=np.int64(2)).keep == 2


def test_initialize_refuses_a_bool_count(monkeypatch):
    monkeypatch.delenv("JAXDP_NUM_PROCESSES", raising=False)
    with pytest.raises(ValueError, match="num_processes=True must be a positive integer"):
        jaxdp.initialize(num_processes=True)
    assert jaxdp.initialize(num_processes=np.int64(1)).devices.size == 8


def test_what_a_numpy_integer_builds_holds_python_integers_and_trains():
    """Stored as ``int``: a numpy integer neither leaks into a record, a compiled
    program's static arguments or a JSON file, nor changes what the step computes."""
    assert type(jaxdp.Parallel(zero_stage=np.int64(1)).zero_stage) is int
    assert type(jaxdp.Skips(max_consecutive=np.int64(3)).max_consecutive) is int
    assert all(type(n) is int for n in sizes(micro_batch_size=np.int64(3)))
    plan = jaxdp.plan.plan_memory(params=1000, num_devices=np.int64(2), global_batch_size=8)
    assert type(plan.num_devices) is int
    numpy_step, python_step = make(accum_steps=np.int64(2)), make(accum_steps=2)
    assert type(numpy_step.accum_steps) is int
    batch = regression_data(24)
    ours, _ = numpy_step(numpy_step.init(mlp_params()), batch)
    theirs, _ = python_step(python_step.init(mlp_params()), batch)
    for a, b in zip(jax_leaves(ours.params), jax_leaves(theirs.params), strict=True):
        np.testing.assert_array_equal(a, b)


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]

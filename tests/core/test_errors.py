"""Acceptance 5: bad input fails early with the argument, the rule and the values."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import mlp_params, mse_loss, regression_data

import jaxdp


def make(**kwargs):
    options = {"mesh": jaxdp.data_mesh(4), "accum_steps": 2} | kwargs
    return jaxdp.make_train_step(mse_loss, optax.sgd(0.1), **options)


def test_global_batch_not_divisible_names_all_three_numbers():
    step = make()
    state = step.init(mlp_params())
    with pytest.raises(
        ValueError, match=r"global_batch_size=30 .* num_devices \* accum_steps = 4 \* 2"
    ):
        step(state, regression_data(30))


def test_multisteps_micro_batch_not_divisible_names_its_numbers():
    step = make(path="multisteps")
    state = step.init(mlp_params())
    with pytest.raises(
        ValueError,
        match=r"30 rows must be a positive multiple of num_devices=4 \(the accum_steps=2",
    ):
        step(state, regression_data(30))
    assert step.sizes(regression_data(12)) == (4, 2, 3, 24)


def test_batch_sizes_rejects_inconsistent_sizes():
    with pytest.raises(
        ValueError,
        match=r"global_batch_size=30 must be a positive multiple of "
        r"num_devices \* accum_steps = 4 \* 2",
    ):
        jaxdp.batch_sizes(num_devices=4, accum_steps=2, global_batch_size=30)
    with pytest.raises(ValueError, match=r"micro_batch_size=3 contradicts global_batch_size=32"):
        jaxdp.batch_sizes(num_devices=4, accum_steps=2, global_batch_size=32, micro_batch_size=3)
    assert jaxdp.batch_sizes(num_devices=4, accum_steps=2, micro_batch_size=3) == (4, 2, 3, 24)


def test_more_devices_than_exist():
    with pytest.raises(ValueError, match=r"num_devices=9 exceeds the 8 available cpu device"):
        jaxdp.data_mesh(9)


def test_emulating_another_count_after_the_backend_started():
    # Started here: first in a worker, nothing else may have started it, and a count
    # set before the start would hold for every later test in the process.
    jax.devices()
    jaxdp.emulate_cpu_devices(8)  # the count the backend has: allowed
    with pytest.raises(
        RuntimeError,
        match=r"emulate_cpu_devices\(num_devices=3\) .* started "
        r"with 8 CPU device",
    ):
        jaxdp.emulate_cpu_devices(3)


def test_a_refused_emulation_leaves_xla_flags_alone(monkeypatch):
    jax.devices()  # started (see above)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    with pytest.raises(RuntimeError, match="num_devices=3"):
        jaxdp.emulate_cpu_devices(3)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_emulate_before_the_backend_starts():
    code = textwrap.dedent("""
        import jax, jaxdp
        jaxdp.emulate_cpu_devices(3)
        print(len(jax.devices()), jaxdp.data_mesh().devices.size)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "", "JAX_PLATFORMS": "cpu"},
    )
    assert out.stdout.split() == ["3", "3"]


def test_replicas_that_differ_name_the_leaf_and_devices():
    mesh = jaxdp.data_mesh(4)
    params = mlp_params()
    good = jax.device_put(params, NamedSharding(mesh, P()))
    jaxdp.check_replicas(good, mesh)  # identical: no error
    # Claim "replicated", but device 2 holds another b0.
    copies = [np.array(params["b0"]) for _ in range(4)]
    copies[2][0] += 1e-9
    bad_leaf = jax.make_array_from_single_device_arrays(
        copies[0].shape,
        NamedSharding(mesh, P()),
        [jax.device_put(c, d) for c, d in zip(copies, mesh.devices.flat, strict=True)],
    )
    bad = dict(good, b0=bad_leaf)
    with pytest.raises(jaxdp.ReplicaMismatchError, match=r"params\['b0'\] differs .* \[2\]"):
        jaxdp.check_replicas(bad, mesh, name="params")
    # init runs the same check before training starts.
    with pytest.raises(jaxdp.ReplicaMismatchError, match=r"\['b0'\]"):
        make().init(bad)


def test_replica_check_sees_sign_of_zero_and_nan():
    mesh = jaxdp.data_mesh(2)
    leaf = jax.make_array_from_single_device_arrays(
        (2,),
        NamedSharding(mesh, P()),
        [jax.device_put(np.array([np.nan, 0.0]), d) for d in mesh.devices.flat],
    )
    jaxdp.check_replicas({"x": leaf}, mesh)  # NaN == NaN bitwise
    signed = jax.make_array_from_single_device_arrays(
        (2,),
        NamedSharding(mesh, P()),
        [
            jax.device_put(np.array(v), d)
            for v, d in zip([[0.0, 1.0], [-0.0, 1.0]], mesh.devices.flat, strict=True)
        ],
    )
    with pytest.raises(jaxdp.ReplicaMismatchError):
        jaxdp.check_replicas({"x": signed}, mesh)


def test_non_scalar_loss():
    step = jaxdp.make_train_step(
        lambda p, b: mse_loss(p, b)[None].repeat(3), optax.sgd(0.1), mesh=jaxdp.data_mesh(2)
    )
    with pytest.raises(
        ValueError, match=r"loss_fn's return value must be a scalar .* shape \(3,\)"
    ):
        step(step.init(mlp_params()), regression_data(4))


def test_weighted_loss_must_return_sum_and_count():
    step = jaxdp.make_train_step(
        mse_loss, optax.sgd(0.1), mesh=jaxdp.data_mesh(2), loss_reduction="weighted"
    )
    with pytest.raises(
        TypeError, match=r"\(loss_sum, count\) tuple .* got one array of shape \(\)"
    ):
        step(step.init(mlp_params()), regression_data(4))


@pytest.mark.parametrize(
    ("option", "value", "rule"),
    [
        ("accum_steps", 0, r"accum_steps=0 must be a positive integer"),
        ("path", "async", r"path='async' must be one of \('fused', 'multisteps'\)"),
        ("strategy", "pjit", r"strategy='pjit' must be one of"),
        ("loss_reduction", "sum", r"loss_reduction='sum' must be one of"),
    ],
)
def test_invalid_options(option, value, rule):
    with pytest.raises(ValueError, match=rule):
        make(**{option: value})


def test_sampler_arguments():
    with pytest.raises(ValueError, match=r"rank=4 must be in \[0, num_replicas - 1\] = \[0, 3\]"):
        jaxdp.DistributedSampler(10, num_replicas=4, rank=4)
    with pytest.raises(ValueError, match=r"dataset_size=3 with drop_last=True leaves no sample"):
        jaxdp.DistributedSampler(3, num_replicas=4, rank=0, drop_last=True)
    bad = jaxdp.DistributedSampler(4, num_replicas=1, rank=0, permutation=lambda n, s: [0, 0, 1, 2])
    with pytest.raises(ValueError, match=r"did not return a permutation of range\(4\)"):
        list(bad)


def test_batch_leaves_must_agree():
    step = make()
    with pytest.raises(ValueError, match=r"same leading size, got \[8, 16\]"):
        step(step.init(mlp_params()), (np.zeros((16, 8)), np.zeros((8, 3))))

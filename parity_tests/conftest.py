"""Parity set-up: 8 emulated CPU devices and float64 before JAX starts, torch on one
thread, and the torch_ref runs of every cell, made once and batched (one DDP start per
world size)."""

import jax
import pytest
import torch

import jaxdp

jaxdp.emulate_cpu_devices(8)
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_default_matmul_precision", "highest")
# torch in pytest's process on one thread, as torch_ref's ranks run: its models are a few
# thousand parameters, and on a loaded machine a second thread's spin-waits cost more
# than it computes (measured at load 13 on 2 cores: test_torch_ref.py's 3-step MLP runs
# took 0.51 CPU s on two threads and 0.02 on one, its gradient check 0.36 and 0.02).
torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    # The tests that read torch_runs go to one xdist worker (with --dist
    # loadgroup), so the batched torch runs below are made once. First among the
    # hooks: xdist reads the group marks in its own (they were added after it, and
    # two workers each made every torch run, 140 s).
    for item in items:
        if "torch_runs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("torch_runs"))


@pytest.fixture(scope="session")
def torch_runs():
    """``{key: (data, initial_state, torch Trajectory)}`` for every cell in cells.ALL
    (key: ``cell_id``) and every run with a torch_ref option in cells.TORCH_OPTIONED
    (ZeroRedundancyOptimizer, the bf16 hook; key: ``torch_key``).

    One-device cells train in this process (torch_ref.train_ga); the DDP runs
    of each world size share ONE start of real gloo processes (train_ddp_many).
    """
    from cells import ALL, TORCH_OPTIONED, cell_id

    import torch_ref
    from jaxdp.parity import Trajectory, torch_config, torch_inputs

    runs, by_world = {}, {}
    for key, config, options in [(cell_id(c), c, {}) for c in ALL] + TORCH_OPTIONED:
        data, initial = torch_inputs(config)
        job = (torch_config(config, **options), data, initial)
        if config.num_devices == 1:
            result = torch_ref.train_ga(*job)
            runs[key] = (data, initial, Trajectory(result.states, result.losses))
        else:
            by_world.setdefault(config.num_devices, []).append((key, job))
    for cells in by_world.values():
        results = torch_ref.train_ddp_many([job for _, job in cells])
        for (key, (_, data, initial)), result in zip(cells, results, strict=True):
            runs[key] = (data, initial, Trajectory(result.states, result.losses))
    return runs

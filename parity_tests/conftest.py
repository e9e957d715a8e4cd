"""Parity set-up: 8 emulated CPU devices and float64 before JAX starts, and the
torch_ref runs of every cell, made once and batched (one DDP start per world size)."""

import jax
import pytest

import jaxdp

jaxdp.emulate_cpu_devices(8)
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_default_matmul_precision", "highest")


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
    """``{cell_id: (data, initial_state, torch Trajectory)}`` for every cell in cells.ALL.

    One-device cells train in this process (torch_ref.train_ga); the DDP cells
    of each world size share ONE start of real gloo processes (train_ddp_many).
    """
    from cells import ALL, cell_id

    import torch_ref
    from jaxdp.parity import Trajectory, torch_config, torch_inputs

    runs, by_world = {}, {}
    for config in ALL:
        data, initial = torch_inputs(config)
        if config.num_devices == 1:
            result = torch_ref.train_ga(torch_config(config), data, initial)
            runs[cell_id(config)] = (data, initial, Trajectory(result.states, result.losses))
        else:
            by_world.setdefault(config.num_devices, []).append((config, data, initial))
    for cells in by_world.values():
        jobs = [(torch_config(c), data, initial) for c, data, initial in cells]
        for (config, data, initial), result in zip(
            cells, torch_ref.train_ddp_many(jobs), strict=True
        ):
            runs[cell_id(config)] = (data, initial, Trajectory(result.states, result.losses))
    return runs

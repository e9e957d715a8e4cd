"""Parity set-up: 8 emulated CPU devices and float64 before JAX starts, torch on one
thread, and the torch_ref DDP runs of every selected test file, made once per run and
batched (one start of real gloo processes per world size)."""

import pickle

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

# A test that reads the batch (through torch_runs or a fixture of its file) runs on this
# xdist worker, so each world size starts its processes once per run.
BATCH_GROUP = "torch_runs"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    # The tests that read torch_batch go to one xdist worker (with --dist loadgroup), so
    # the batched torch runs below are made once. First among the hooks: xdist reads the
    # group marks in its own (they were added after it, and two workers each made every
    # torch run, 140 s).
    for item in items:
        if "torch_batch" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(BATCH_GROUP))
            # xdist joins every group a test is marked with into one name: another mark
            # (its module's) makes a group of its own, run apart from the batch's, on
            # another worker or later on the same one (whose session fixtures xdist
            # tears down when its queue runs dry): either made the batch again, 40 CPU s.
            groups = {  # as xdist reads a group's name
                m.args[0] if m.args else m.kwargs.get("name", "default")
                for m in item.iter_markers("xdist_group")
            }
            if groups != {BATCH_GROUP}:
                raise pytest.UsageError(
                    f"{item.nodeid} reads torch_batch, so its only xdist group must be "
                    f"{BATCH_GROUP!r}; it is also in {sorted(groups - {BATCH_GROUP})}"
                )


def _batch_owners(items) -> dict:
    """``{owner: torch_jobs}`` of the selected tests that read the batch: ``"torch_runs"``
    (the cells of cells.py) and each test module that defines ``torch_jobs()``."""
    owners = {}
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "torch_batch" not in names:
            continue
        if "torch_runs" in names:
            owners["torch_runs"] = _cell_jobs
        module = getattr(item, "module", None)
        if hasattr(module, "torch_jobs"):
            # A file that imports another's torch_jobs shares its runs (the owner is the
            # module that defines it), so they are made once.
            owners[module.torch_jobs.__module__] = module.torch_jobs
    return owners


@pytest.fixture(scope="session")
def torch_batch(request):
    """``{owner: {key: torch_ref.Result}}``: every torch_ref DDP job of the run, made in
    ONE start of real gloo processes per (world size, device), shared by the test files
    (issue 31: "torch reference runs computed once per run and shared").

    The owners are the modules that define the selected tests' ``torch_jobs() -> {key:
    (config, data, initial_state)}`` (its ``__module__`` is the owner: a file that imports
    another's reads that one's runs), and ``"torch_runs"`` for the
    cells of cells.py. A start runs its jobs in order, each as ``train_ddp_many`` would
    alone: a job's result does not depend on the others (test_torch_ref.py's torchrun
    test checks two of them bitwise against a launch of their own), so equal jobs run once
    and each asker reads the one result."""
    import torch_ref

    # {layout: {the job's pickle: (job, [(owner, key), ...])}}: a job two owners (or two
    # keys) ask for, equal in config, data and initial state, runs once.
    by_layout = {}
    for owner, jobs in _batch_owners(request.session.items).items():
        for key, job in jobs().items():
            same = by_layout.setdefault((job[0].num_devices, job[0].device), {})
            same.setdefault(pickle.dumps(job), (job, []))[1].append((owner, key))
    results = {}
    for same in by_layout.values():
        done = torch_ref.train_ddp_many([job for job, _ in same.values()])
        for (_, askers), result in zip(same.values(), done, strict=True):
            for owner, key in askers:
                results.setdefault(owner, {})[key] = result
    return results


def _cell_jobs() -> dict:
    """The DDP jobs of torch_runs (its one-device cells train in pytest's process)."""
    from cells import ALL, TORCH_OPTIONED, cell_id

    from jaxdp.parity import torch_config, torch_inputs

    jobs = {}
    for key, config, options in [(cell_id(c), c, {}) for c in ALL] + TORCH_OPTIONED:
        if config.num_devices > 1:
            jobs[key] = (torch_config(config, **options), *torch_inputs(config))
    return jobs


@pytest.fixture(scope="session")
def torch_runs(torch_batch):
    """``{key: (data, initial_state, torch Trajectory)}`` for every cell in cells.ALL
    (key: ``cell_id``) and every run with a torch_ref option in cells.TORCH_OPTIONED
    (ZeroRedundancyOptimizer, the bf16 hook; key: ``torch_key``).

    One-device cells train in this process (torch_ref.train_ga); the DDP runs come from
    the run's shared batch (torch_batch).
    """
    from cells import ALL, TORCH_OPTIONED, cell_id

    import torch_ref
    from jaxdp.parity import Trajectory, torch_config, torch_inputs

    runs, ddp = {}, torch_batch["torch_runs"]
    for key, config, options in [(cell_id(c), c, {}) for c in ALL] + TORCH_OPTIONED:
        data, initial = torch_inputs(config)
        if config.num_devices == 1:
            result = torch_ref.train_ga(torch_config(config, **options), data, initial)
        else:
            result = ddp[key]
        runs[key] = (data, initial, Trajectory(result.states, result.losses))
    return runs

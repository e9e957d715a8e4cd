"""Starting the DDP ranks: ``torch.multiprocessing.spawn`` or torchrun, one process group.

The jobs travel to the ranks as a pickle file and rank 0's results come back
the same way, so both launchers run the same ``worker``.
"""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RankJobs = Callable[[int, int, Sequence[Any]], list[Any]]
"""``run(rank, world_size, jobs) -> results``, called inside the process group."""


def save_jobs(path: str | os.PathLike, jobs: Sequence[Any]) -> None:
    """Writes jobs for ``python -m torch_ref`` (a pickle of ``(config, data, state)`` tuples)."""
    Path(path).write_bytes(pickle.dumps(list(jobs)))


def load_results(path: str | os.PathLike) -> list[Any]:
    """Reads the results ``python -m torch_ref`` wrote (a pickle of ``Result``s)."""
    return pickle.loads(Path(path).read_bytes())


def pin_cuda_precision() -> None:
    """float32 matmuls and convolutions in full precision (no TF32), deterministic cuDNN."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def launch(run: RankJobs, jobs: Sequence[Any], *, world_size: int, launcher: str) -> list[Any]:
    """Starts ``world_size`` processes once, runs ``run`` on all ``jobs`` in each, and
    returns rank 0's results. ``run`` must be importable (spawn pickles it by name)."""
    with tempfile.TemporaryDirectory(prefix="torch_ref-") as tmp:
        jobs_path, results_path = Path(tmp, "jobs.pkl"), Path(tmp, "results.pkl")
        save_jobs(jobs_path, jobs)
        if launcher == "spawn":
            # The ranks meet through a file (torch's shared-file initialization), not a
            # port found free and released: another process could take that port first.
            store = str(Path(tmp, "store"))
            args = (world_size, run, str(jobs_path), str(results_path), store)
            mp.spawn(worker, args=args, nprocs=world_size, join=True)
        else:
            _torchrun(world_size, jobs_path, results_path)
        return load_results(results_path)


def worker(
    rank: int,
    world_size: int,
    run: RankJobs,
    jobs_path: str,
    results_path: str,
    store: str | None = None,
) -> None:
    """One rank: joins the process group (gloo on CPU, nccl on CUDA with GPU ``rank``),
    runs the jobs, and rank 0 writes the results. ``store`` (spawn) is the file the
    ranks meet through (``init_method="file://..."``); torchrun sets MASTER_ADDR,
    MASTER_PORT, RANK and WORLD_SIZE itself."""
    jobs = pickle.loads(Path(jobs_path).read_bytes())
    if jobs[0][0].device == "cuda":
        pin_cuda_precision()
        torch.cuda.set_device(rank)
        backend = "nccl"
    else:
        torch.set_num_threads(1)  # the ranks share the machine's cores
        backend = "gloo"
    init_method = None if store is None else f"file://{store}"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        results = run(rank, world_size, jobs)
        # Free what the runs left in reference cycles while the group is alive and
        # in step: without this the ranks aborted now and then at interpreter exit
        # ("terminate called without an active exception", gloo, torch 2.13).
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(results_path).write_bytes(pickle.dumps(results))


def _torchrun(world_size: int, jobs_path: Path, results_path: Path) -> None:
    """``torchrun --standalone --nproc-per-node W -m torch_ref JOBS RESULTS``."""
    torchrun(world_size, ["-m", "torch_ref", str(jobs_path), str(results_path)])


def torchrun(world_size: int, target: Sequence[str], env: dict[str, str] | None = None) -> None:
    """``torchrun --standalone --nproc-per-node W TARGET...`` (a script and its arguments,
    or ``-m MODULE ...``), every rank on one thread and able to import this torch_ref;
    ``env`` adds variables. Raises ``RuntimeError`` with the ranks' stderr if it fails."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",  # what the `torchrun` console script runs
        "--standalone",
        f"--nproc-per-node={world_size}",
        *target,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    # The ranks import this very torch_ref, installed or not.
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited with status {done.returncode}:\n{done.stderr[-4000:]}")

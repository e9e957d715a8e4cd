"""``torchrun --standalone --nproc-per-node W -m torch_ref JOBS RESULTS``: one DDP rank.

JOBS is a file written by ``torch_ref.save_jobs`` (``(config, data,
initial_state)`` tuples, all with ``num_devices == W``); rank 0 writes the
``Result`` of every job to RESULTS, read back with ``torch_ref.load_results``.
"""

from __future__ import annotations

import argparse
import os

from ._launch import worker
from .train import _run_rank_jobs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="torchrun ... -m torch_ref", description=__doc__)
    parser.add_argument("jobs", help="jobs file from torch_ref.save_jobs")
    parser.add_argument("results", help="where rank 0 writes the results")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        parser.error("RANK and WORLD_SIZE are unset: start this module with torchrun")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    worker(rank, world_size, _run_rank_jobs, args.jobs, args.results)


if __name__ == "__main__":
    main()

"""``torchrun --standalone --nproc-per-node W -m torch_ref JOBS RESULTS``: one DDP rank.

JOBS is a file written by ``torch_ref.save_jobs`` (``(config, data,
initial_state)`` tuples, all with ``num_devices == W``); rank 0 writes the
``Result`` of every job to RESULTS, read back with ``torch_ref.load_results``.
``--zero`` and ``--comm-hook bf16`` set ``TrainConfig.zero`` and
``TrainConfig.comm_hook`` in every job; ``--fsdp`` (FSDP2 instead of DDP) and
``--shards S`` (HSDP with ``S`` ranks per shard group) set ``fsdp`` and ``shards``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from collections.abc import Sequence
from typing import Any

from ._launch import worker
from .comm_hooks import COMM_HOOKS
from .train import Job, Result, _run_rank_jobs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="torchrun ... -m torch_ref", description=__doc__)
    parser.add_argument("jobs", help="jobs file from torch_ref.save_jobs")
    parser.add_argument("results", help="where rank 0 writes the results")
    parser.add_argument(
        "--zero",
        action="store_true",
        help="every job's optimizer inside ZeroRedundancyOptimizer (state sharded over ranks)",
    )
    parser.add_argument(
        "--comm-hook",
        choices=COMM_HOOKS,
        default=None,
        help="every job's DDP communication hook (bf16: torch's bf16_compress_hook)",
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="every job trained with FSDP2 (fully_shard per block, then the root) instead of DDP",
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=None,
        metavar="S",
        help="with --fsdp: parameters split over S ranks, W // S replicas (HSDP); default W",
    )
    args = parser.parse_args(argv)
    if args.shards is not None and not args.fsdp:
        parser.error(f"--shards {args.shards} needs --fsdp")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        parser.error("RANK and WORLD_SIZE are unset: start this module with torchrun")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    overrides = {"zero": True} if args.zero else {}
    if args.comm_hook is not None:
        overrides["comm_hook"] = args.comm_hook
    if args.fsdp:
        overrides.update(fsdp=True, shards=args.shards)
    run = functools.partial(_run_overridden, overrides)
    worker(rank, world_size, run, args.jobs, args.results)


def with_overrides(jobs: Sequence[Job], overrides: dict[str, Any]) -> list[Job]:
    """``jobs`` with ``overrides`` set in every config (validated as the config is)."""
    return [(dataclasses.replace(config, **overrides), data, state) for config, data, state in jobs]


def _run_overridden(
    overrides: dict[str, Any], rank: int, world_size: int, jobs: Sequence[Job]
) -> list[Result]:
    return _run_rank_jobs(rank, world_size, with_overrides(jobs, overrides))


if __name__ == "__main__":
    main()

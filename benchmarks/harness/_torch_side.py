"""The torch half of ``vs_torch``: torch_ref's models and its own optimizer-step code, timed.

The timed step is ``torch_ref.train_window``, the function torch_ref
trains with (``loss / K`` per micro-batch, ``no_sync`` on all but the last
under DDP, ``optimizer.step()``, ``zero_grad``), followed by ``loss.item()``.
Batches are prepared tensors, as the jaxdp side's are device arrays: data
loading is excluded on both sides.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import torch_ref

from ._common import OPTIMIZER, BenchModel

Window = list[tuple[torch.Tensor, torch.Tensor]]


def torch_model(bm: BenchModel) -> nn.Module:
    """torch_ref's model of the same layout and sizes (float32, seed 0)."""
    torch.manual_seed(0)
    if bm.kind == "transformer":
        return torch_ref.Transformer(**bm.sizes())
    if not bm.kwargs:
        return torch_ref.MLP()  # the reference 16-32-32-4
    s = bm.sizes()
    return _WiderMLP(s["in_features"], s["hidden"], s["num_classes"])


class _WiderMLP(torch_ref.MLP):
    """torch_ref.MLP (its layer names and forward) at other widths; torch_ref fixes 16-32-32-4."""

    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        nn.Module.__init__(self)  # not MLP.__init__, which builds the fixed sizes
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)


def train_config(bm: BenchModel, *, num_devices: int, accum_steps: int) -> Any:
    optim = torch_ref.OptimConfig(
        OPTIMIZER.name, OPTIMIZER.learning_rate, weight_decay=OPTIMIZER.weight_decay
    )
    return torch_ref.TrainConfig(
        bm.kind,
        optim,
        bm.micro_batch_size,
        num_devices=num_devices,
        accum_steps=accum_steps,
        dtype="float32",
    )


def window(data: tuple[np.ndarray, np.ndarray], micro: int, accum_steps: int) -> Window:
    """``accum_steps`` micro-batches of ``micro`` rows from the front of ``data``."""
    x, y = (torch.from_numpy(np.ascontiguousarray(a)) for a in data)
    x = x if x.is_floating_point() else x.long()
    return [
        (x[j * micro : (j + 1) * micro], y[j * micro : (j + 1) * micro].long())
        for j in range(accum_steps)
    ]


def stepper(config: Any, model: nn.Module, rows: Window) -> Callable[[], float]:
    """One optimizer step of torch_ref's loop on ``rows``, returning the loss (a sync point)."""
    optimizer = torch_ref.build_optimizer(model.parameters(), config.optimizer)
    device = torch.device("cpu")
    return lambda: torch_ref.train_window(config, model, optimizer, rows, device).item()


def _on_threads(threads: int, step: Callable[[], float]) -> Callable[[], float]:
    """``step`` on ``threads`` torch threads; steps of other thread counts may run between."""

    def run() -> float:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return step()

    return run


def ga_stepper(bm: BenchModel, accum_steps: int, threads: int) -> Callable[[], float]:
    """Single-process gradient accumulation on ``threads`` torch threads."""
    config = train_config(bm, num_devices=1, accum_steps=accum_steps)
    rows = bm.micro_batch_size * accum_steps
    step = stepper(config, torch_model(bm), window(bm.data(rows), bm.micro_batch_size, accum_steps))
    return _on_threads(threads, step)


def component_steppers(bm: BenchModel, threads: int) -> dict[str, Callable[[], float]]:
    """torch_ref's parts of a step: one micro-batch's forward and backward (``.grad``
    accumulating, as within a window), and one ``optimizer.step()``."""
    config = train_config(bm, num_devices=1, accum_steps=1)
    model = torch_model(bm)
    optimizer = torch_ref.build_optimizer(model.parameters(), config.optimizer)
    ((x, y),) = window(bm.data(bm.micro_batch_size), bm.micro_batch_size, 1)

    def micro() -> float:
        loss = torch_ref.compute_loss(config.model, model, x, y)
        loss.backward()
        return loss.item()

    def update() -> float:
        optimizer.step()  # the gradients stay: every call updates (eager: done on return)
        return 0.0

    micro()
    return {"micro": _on_threads(threads, micro), "update": _on_threads(threads, update)}


def run_ddp(
    models: Sequence[BenchModel],
    *,
    num_devices: int,
    accum_steps: int,
    threads: int,
    repeats: int,
    sample_seconds: float,
) -> list[dict[str, Any]]:
    """torch_ref's DDP step on ``num_devices`` gloo ranks (real processes), timed inside
    them; one start of the ranks runs every model (starting them costs seconds)."""
    jobs = []
    for bm in models:
        config = train_config(bm, num_devices=num_devices, accum_steps=accum_steps)
        data = bm.data(num_devices * accum_steps * bm.micro_batch_size)
        options = {
            "model": bm,
            "threads": threads,
            "repeats": repeats,
            "sample_seconds": sample_seconds,
        }
        jobs.append((config, data, options))
    return torch_ref.launch(_ddp_rank, jobs, world_size=num_devices, launcher="spawn")


def _ddp_rank(rank: int, world_size: int, jobs: Sequence[Any]) -> list[dict[str, Any]]:
    """One rank (spawned by torch_ref's launcher, process group up) runs every job."""
    return [_ddp_job(rank, *job) for job in jobs]


def _ddp_job(rank: int, config: Any, data: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Warm up, then time ``repeats`` samples of torch_ref's DDP step on this rank's share."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(options["threads"])  # the machine's cores shared among the ranks
    bm: BenchModel = options["model"]
    per_rank = config.accum_steps * bm.micro_batch_size
    share = tuple(a[rank * per_rank : (rank + 1) * per_rank] for a in data)
    rows = window(share, bm.micro_batch_size, config.accum_steps)
    step = stepper(config, DDP(torch_model(bm)), rows)
    for _ in range(2):
        step()
    start = time.perf_counter()
    step()
    once = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(once, op=dist.ReduceOp.MAX)  # every rank picks the same number of calls
    calls = max(1, round(options["sample_seconds"] / float(once)))
    samples = []
    for _ in range(options["repeats"]):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        dist.barrier()
        samples.append((time.perf_counter() - start) / calls)
    return {"seconds_per_step": samples, "calls": calls, "threads": torch.get_num_threads()}

"""The reference training loop: PyTorch DDP with gradient accumulation, as its docs teach it.

One optimizer step ("window") on each of the ``W = num_devices`` ranks:

1. The rank's ``DistributedSampler`` (``set_epoch(epoch)`` each epoch) feeds a
   ``DataLoader(batch_size=micro_batch_size, drop_last=True)``: a partial
   micro-batch at the end of a rank's share is dropped, never padded.
2. ``K = accum_steps`` consecutive micro-batches form a window. The first
   ``K - 1`` run forward AND backward inside ``model.no_sync()``, so their
   gradients accumulate locally in ``.grad``; each backward is of
   ``loss_j / K``. The last micro-batch's backward runs synced: DDP multiplies
   each rank's gradient by ``1 / W`` and all-reduces with SUM, so every rank
   holds ``(1 / (W K)) * sum over ranks and micro-batches of grad(loss_j)``.
3. Optional ``clip_grad_norm_(max_grad_norm)`` on the synced gradients, then
   ``optimizer.step()`` and ``optimizer.zero_grad(set_to_none=True)``.

Two DDP options change how the step communicates, not what it computes:
``zero=True`` wraps the optimizer in ``ZeroRedundancyOptimizer`` (each rank
keeps and steps the state of the parameters it owns, then broadcasts them);
``comm_hook="bf16"`` registers torch's ``bf16_compress_hook``, so the synced
backward sends each rank's gradient bucket as bfloat16 (cast, divided by ``W``,
all-reduced with SUM in bfloat16 by gloo or nccl, cast back into ``.grad``;
on CPU under another name, see ``torch_ref.comm_hooks``).

``fsdp=True`` trains with PyTorch's FSDP2 instead of DDP, as its docs teach it
(ZeRO stage 3: parameters, gradients and optimizer state sharded):
``fully_shard(block, mesh=mesh)`` on every block of each ``nn.ModuleList`` in
the model, then ``fully_shard(model, mesh=mesh)`` on the root; each parameter
is split along its dimension 0 (padded where ``num_devices`` does not divide
it), gathered for a block's forward and again for its backward, and its
gradient reduce-scattered, averaged over the ranks. The mesh is
``init_device_mesh(device, (num_devices,))``; with ``shards=S < num_devices``
it is HSDP's 2-D mesh ``(num_devices // S, S)`` named ``("replicate",
"shard")``: parameters split over the ``S`` ranks of a shard group, the
gradient reduce-scattered within it and all-reduced across the groups. The
first ``K - 1`` micro-batches run under ``set_requires_gradient_sync(False)``
(FSDP2's ``no_sync``: no reduce-scatter, no all-reduce), the last one synced;
the clip (``clip_grad_norm_`` on the sharded gradients) and the optimizer work
on the shards. The data, its order and the update are DDP's.

``tp=T > 1`` adds tensor parallelism (``torch_ref.tensor_parallel``): the model's
Megatron plan applied with ``parallelize_module`` over the ``"tp"`` dimension of a
``("dp", "tp")`` mesh of ``(num_devices // T, T)``, then DDP or FSDP2 over ``"dp"``
as above (with ``shards=S``, HSDP: FSDP2 on the ``("replicate", "shard")`` submesh of a
``(num_devices // T // S, S, T)`` mesh, S data ranks per shard group). The ``T`` ranks
of a data rank read the same micro-batches (its sampler has
``num_replicas=num_devices // T``): the data, its order and the update are
those of DDP on ``num_devices // T`` ranks.

The last, incomplete window of an epoch (``r = micro-batches % K > 0``) follows
``last_window``: ``"drop"`` (default) skips its ``r`` micro-batches without a
forward, so every update averages exactly ``W K`` micro-batches (the same
global batch size, which is what the learning rate was tuned for);
``"step"`` runs them with ``loss / r`` and steps, so that update is the mean of
the ``W r`` micro-batches it saw (weighted by its real size).

The reported loss of a step is ``sum_j loss_j / k`` (``k`` = ``K``, or ``r``),
averaged over ranks with one all_reduce after the step (for logging only).

``loss_reduction="weighted"`` is the token-weighted loss of padded batches as a DDP
script writes it (Hugging Face's ``num_items_in_batch``): the loss returns
``(loss_sum, count)`` of a micro-batch; before the window's backward passes, a
forward without gradients (``model.eval()``: no dropout, no running statistics
moved) counts the window's items on every rank, one ``all_reduce`` sums them over
the ranks, and each micro-batch's backward is of ``loss_sum * W / count`` (DDP then
divides by ``W``): the update is of the sum of every rank's loss sums over the
global count. ``lr_scheduler`` (a factory ``optimizer -> LRScheduler``, e.g.
``LambdaLR`` or ``OneCycleLR``) steps after every optimizer step, as its docs teach.
``train_ga`` is the same loop in one process without DDP: its sampler has
``num_replicas=1``, so its order is the permutation itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ._launch import launch, pin_cuda_precision
from .comm_hooks import COMM_HOOKS, register_comm_hook
from .models import (
    build_model,
    check_model_name,
    compute_loss,
    convert_sync_batchnorm,
    numpy_state_dict,
    torch_dtype,
)
from .optim import OptimConfig, build_optimizer, local_bytes, optimizer_state_bytes
from .tensor_parallel import MEGATRON_PLANS, tensor_parallel
from .user import (
    LOSSES,
    build_user_model,
    check_user_model,
    is_user_model,
    loss_function,
    scheduler_factory,
)

Data = tuple[np.ndarray, np.ndarray]
State = dict[str, np.ndarray]
Job = tuple["TrainConfig", Data, State]


@dataclass(frozen=True)
class TrainConfig:
    """One training run. ``global_batch_size = data_ranks * accum_steps * micro_batch_size``
    (``data_ranks``: ``num_devices // tp``)."""

    # One of torch_ref.MODELS, or a user's model: a "MODULE:ATTR" spec, a class or
    # factory returning an nn.Module, or an nn.Module (torch_ref.user).
    model: Any
    optimizer: OptimConfig
    micro_batch_size: int  # rows per forward/backward on one rank
    num_devices: int = 1  # DDP world size (one process per rank)
    accum_steps: int = 1  # K micro-batches per optimizer step on each rank
    epochs: int = 1
    max_steps: int | None = None  # stop after this many optimizer steps
    shuffle: bool = True  # DistributedSampler's shuffle
    seed: int = 0  # DistributedSampler's seed: epoch e uses torch_permutation(n, seed + e)
    drop_last: bool = False  # DistributedSampler's: cut the tail instead of padding it
    last_window: Literal["drop", "step"] = "drop"  # the epoch's incomplete window
    dtype: str = "float64"  # parameters and floating data
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (nccl, one GPU per rank, TF32 off)
    sync_batchnorm: bool = False  # DDP: BatchNorm statistics over all ranks (SyncBatchNorm)
    find_unused_parameters: bool = False  # DDP's: allow parameters without a gradient
    # loss(output, y) of one micro-batch: "mse", "cross_entropy", a "MODULE:ATTR" spec or
    # a callable; None: the reference model's own loss (compute_loss).
    loss: Any = None
    # "weighted": the loss returns (loss_sum, count) and the step's gradient is of the sum
    # over every micro-batch and rank over the global count (see the module docstring).
    loss_reduction: Literal["mean", "weighted"] = "mean"
    # A factory optimizer -> torch.optim.lr_scheduler.LRScheduler (LambdaLR, OneCycleLR...),
    # a "MODULE:ATTR" spec of one, or None: a constant learning rate. Stepped after every
    # optimizer step.
    lr_scheduler: Any = None
    # DDP only (train_ddp; num_devices=1 runs one rank): ZeroRedundancyOptimizer around
    # the optimizer, its state sharded over the ranks (ZeRO stage 1; DDP still
    # all-reduces whole gradients), and a DDP communication hook (torch_ref.comm_hooks).
    zero: bool = False
    comm_hook: Literal["bf16"] | None = None
    # Instead of DDP (train_ddp): FSDP2 (fully_shard per block, then the root), the
    # parameters split over `shards` ranks (None: all num_devices); shards < num_devices
    # is HSDP, num_devices // shards replicas of a sharded model on a 2-D mesh.
    fsdp: bool = False
    shards: int | None = None
    # Tensor parallelism (torch_ref.tensor_parallel): the model's Megatron plan over `tp`
    # ranks of a (dp, tp) mesh, under DDP or FSDP2 over the num_devices // tp data ranks.
    tp: int = 1

    def __post_init__(self) -> None:
        if is_user_model(self.model):
            check_user_model(self.model)
            if self.loss is None:
                raise ValueError(
                    f"model={self.model!r} is a user's model: give its loss ('mse', "
                    "'cross_entropy', a 'MODULE:ATTR' spec or a callable)"
                )
        else:
            check_model_name(self.model)
        if self.loss is not None:
            loss_function(self.loss)  # fails early on a bad name or spec
        if self.loss_reduction not in ("mean", "weighted"):
            raise ValueError(f"loss_reduction={self.loss_reduction!r} must be 'mean' or 'weighted'")
        if self.loss_reduction == "weighted" and self.loss in (None, *LOSSES):
            raise ValueError(
                f"loss_reduction='weighted' needs a loss of your own returning (loss_sum, "
                f"count), got loss={self.loss!r}"
            )
        if self.lr_scheduler is not None:
            scheduler_factory(self.lr_scheduler)  # fails early on a bad spec
        if not isinstance(self.optimizer, OptimConfig):
            raise TypeError(f"optimizer={self.optimizer!r} must be an OptimConfig")
        for name in ("micro_batch_size", "num_devices", "accum_steps", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps} must be at least 1 (or None)")
        if self.last_window not in ("drop", "step"):
            raise ValueError(f"last_window={self.last_window!r} must be 'drop' or 'step'")
        torch_dtype(self.dtype)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} must be 'cpu' or 'cuda'")
        if not isinstance(self.zero, bool):
            raise TypeError(f"zero={self.zero!r} must be True or False")
        if self.comm_hook is not None and self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook={self.comm_hook!r} must be None or one of {COMM_HOOKS}")
        if not isinstance(self.fsdp, bool):
            raise TypeError(f"fsdp={self.fsdp!r} must be True or False")
        if self.shards is not None:
            if not self.fsdp:
                raise ValueError(f"shards={self.shards} needs fsdp=True (DDP shards nothing)")
            if self.shards < 1 or self.num_devices % self.shards:
                raise ValueError(
                    f"shards={self.shards} must be a divisor of num_devices={self.num_devices} "
                    f"(num_devices // shards replicas of shards ranks each)"
                )
        self._check_tp()
        if self.fsdp:
            ddp_only = {
                "zero": self.zero,
                "comm_hook": self.comm_hook,
                "sync_batchnorm": self.sync_batchnorm,
                "find_unused_parameters": self.find_unused_parameters,
            }
            if any(ddp_only.values()):
                given = ", ".join(f"{k}={v!r}" for k, v in ddp_only.items() if v)
                raise ValueError(
                    f"{given} configures DDP; fsdp=True trains with FSDP2 instead (it shards "
                    "the optimizer state itself): leave it at its default"
                )

    def _check_tp(self) -> None:
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ValueError(f"tp={self.tp!r} must be a whole number, at least 1")
        if self.num_devices % self.tp:
            raise ValueError(
                f"tp={self.tp} must be a divisor of num_devices={self.num_devices} "
                "(num_devices // tp data ranks of tp ranks each)"
            )
        if self.tp == 1:
            return
        if not isinstance(self.model, str) or self.model not in MEGATRON_PLANS:
            raise ValueError(
                f"tp={self.tp} needs a model with a Megatron plan: "
                f"{', '.join(map(repr, MEGATRON_PLANS))} (torch_ref.tensor_parallel."
                f"MEGATRON_PLANS), got model={self.model!r}"
            )
        alone = {
            "zero": self.zero,
            "comm_hook": self.comm_hook,
            "sync_batchnorm": self.sync_batchnorm,
            "find_unused_parameters": self.find_unused_parameters,
            "loss_reduction": None if self.loss_reduction == "mean" else self.loss_reduction,
        }
        if any(v not in (None, False) for v in alone.values()):
            given = ", ".join(f"{k}={v!r}" for k, v in alone.items() if v not in (None, False))
            raise ValueError(
                f"tp={self.tp} with {given} is not built: tensor parallelism composes with "
                "plain DDP or FSDP2 (HSDP with shards) over the data ranks"
            )
        if self.shards is not None and self.data_ranks % self.shards:
            raise ValueError(
                f"tp={self.tp} with shards={self.shards}: shards (data ranks per shard group) "
                f"must divide the {self.data_ranks} data ranks"
            )

    @property
    def data_ranks(self) -> int:
        """The ranks that read different micro-batches: ``num_devices // tp``."""
        return self.num_devices // self.tp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """FSDP2's device mesh: ``(num_devices,)``, or HSDP's ``(replicas, shards)``."""
        if self.shards is None or self.shards == self.num_devices:
            return (self.num_devices,)
        return (self.num_devices // self.shards, self.shards)


@dataclass
class Result:
    """What one run returns (rank 0's view; every rank holds the same weights)."""

    states: list[dict[str, np.ndarray]]  # state_dict (no "module." prefix) after EVERY step
    losses: list[float]  # per step: mean over ranks of sum_j loss_j / k
    final: dict[str, np.ndarray]  # the state_dict at the end
    # Per rank, at the end: bytes of optimizer state the rank holds (1/W-ish with zero
    # or fsdp), and of parameters (its shards under fsdp).
    optimizer_state_bytes: list[int] = field(default_factory=list)
    parameter_bytes: list[int] = field(default_factory=list)


def torch_permutation(n: int, seed: int) -> np.ndarray:
    """The order ``DistributedSampler(shuffle=True)`` uses in epoch ``e`` when ``seed`` is
    its ``seed + e``: ``torch.randperm(n)`` from a generator seeded with ``seed``."""
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randperm(n, generator=g).numpy()


def micro_batches_per_epoch(config: TrainConfig, num_samples: int) -> int:
    """Whole micro-batches each rank's loader yields per epoch (a partial one is dropped)."""
    share = DistributedSampler(
        range(num_samples),
        num_replicas=config.data_ranks,
        rank=0,
        shuffle=False,
        drop_last=config.drop_last,
    )
    return len(share) // config.micro_batch_size


def steps_per_epoch(config: TrainConfig, num_samples: int) -> int:
    """Optimizer steps per epoch (before ``max_steps``): whole windows, plus the
    incomplete one under ``last_window="step"``."""
    full, rest = divmod(micro_batches_per_epoch(config, num_samples), config.accum_steps)
    return full + (rest > 0 and config.last_window == "step")


def check_job(config: TrainConfig, data: Data, initial_state: State) -> None:
    """Raises ``ValueError`` for data or weights that do not fit ``config``, before any work."""
    x, y = data
    if len(x) != len(y):
        raise ValueError(f"data: x has {len(x)} rows but y has {len(y)}")
    if len(x) < config.data_ranks:
        raise ValueError(f"data has {len(x)} rows, fewer than {config.data_ranks} data ranks")
    if steps_per_epoch(config, len(x)) == 0:
        raise ValueError(
            f"data of {len(x)} rows gives each of {config.data_ranks} data ranks "
            f"{micro_batches_per_epoch(config, len(x))} micro-batches of "
            f"micro_batch_size={config.micro_batch_size}, fewer than accum_steps="
            f"{config.accum_steps} with last_window='drop': no optimizer step"
        )
    expected = {k: tuple(v.shape) for k, v in _build(config).state_dict().items()}
    given = {k: tuple(np.shape(v)) for k, v in initial_state.items()}
    if given != expected:
        missing, unexpected = sorted(expected.keys() - given), sorted(given.keys() - expected)
        shapes = {k: (given[k], expected[k]) for k in given.keys() & expected}
        shapes = {k: pair for k, pair in shapes.items() if pair[0] != pair[1]}
        raise ValueError(
            f"initial_state does not fit model={config.model!r}: missing {missing}, "
            f"unexpected {unexpected}, mis-shaped (given, expected) {shapes}"
        )


def train_ga(config: TrainConfig, data: Data, initial_state: State) -> Result:
    """Gradient accumulation in this process, without DDP: the loop of the module docstring
    with ``W = 1``. With ``device="cuda"`` this turns TF32 off process-wide."""
    if config.num_devices != 1:
        raise ValueError(
            f"train_ga runs one process: num_devices={config.num_devices} must be 1 "
            "(use train_ddp for several ranks)"
        )
    needs_group = {"zero": config.zero, "comm_hook": config.comm_hook, "fsdp": config.fsdp}
    if any(needs_group.values()):
        given = ", ".join(f"{k}={v!r}" for k, v in needs_group.items() if v)
        raise ValueError(
            f"train_ga runs without DDP or a process group: {given} needs train_ddp "
            "(with num_devices=1 it runs one rank)"
        )
    check_job(config, data, initial_state)
    if config.device == "cuda":
        pin_cuda_precision()
    return _run(config, data, initial_state, rank=0, world_size=1, grouped=False)


def train_ddp(
    config: TrainConfig,
    data: Data,
    initial_state: State,
    *,
    launcher: Literal["spawn", "torchrun"] = "spawn",
) -> Result:
    """DDP (or FSDP2 with ``config.fsdp``) over ``config.num_devices`` real processes
    (gloo on CPU, nccl on CUDA).

    ``launcher="spawn"``: ``torch.multiprocessing.spawn``; ``"torchrun"``: a
    ``torchrun --standalone --nproc-per-node W -m torch_ref JOBS RESULTS``
    subprocess. Starting the processes costs seconds: batch runs with
    ``train_ddp_many``.
    """
    return train_ddp_many([(config, data, initial_state)], launcher=launcher)[0]


def train_ddp_many(
    jobs: Sequence[Job], *, launcher: Literal["spawn", "torchrun"] = "spawn"
) -> list[Result]:
    """Runs every ``(config, data, initial_state)`` job, in order, inside ONE start of
    ``W`` processes and one process group; all jobs must share ``num_devices`` and
    ``device``. Returns one ``Result`` per job."""
    if launcher not in ("spawn", "torchrun"):
        raise ValueError(f"launcher={launcher!r} must be 'spawn' or 'torchrun'")
    jobs = list(jobs)
    if not jobs:
        raise ValueError("jobs is empty")
    layouts = sorted({(c.num_devices, c.device) for c, _, _ in jobs})
    if len(layouts) > 1:
        raise ValueError(f"jobs mix (num_devices, device) layouts {layouts}; run them apart")
    world_size, device = layouts[0]
    for job in jobs:
        check_job(*job)
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"num_devices={world_size} needs one GPU per rank; "
            f"{torch.cuda.device_count()} are visible"
        )
    return launch(_run_rank_jobs, jobs, world_size=world_size, launcher=launcher)


def _run(
    config: TrainConfig,
    data: Data,
    initial_state: State,
    *,
    rank: int,
    world_size: int,
    grouped: bool,
) -> Result:
    """The loop of one rank: ``grouped`` wraps the model in DDP, or shards it with FSDP2
    under ``config.fsdp`` (a process group must be up)."""
    device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
    dtype = torch_dtype(config.dtype)
    module = _build(config)
    module.load_state_dict(
        {
            k: torch.as_tensor(v, dtype=dtype if v.dtype.kind == "f" else None)
            for k, v in initial_state.items()
        },
        strict=True,
    )
    module.to(device)
    model = module
    state_dict = numpy_state_dict
    named = None  # the parameters as the optimizer takes them: module.named_parameters()
    clip = None  # the window's gradient clip: torch's clip_grad_norm_
    collective = config.fsdp or config.tp > 1  # the recorded state is gathered
    if grouped and config.tp > 1:
        shard = (lambda m, mesh: _fully_shard(m, config, mesh)) if config.fsdp else None
        split = tensor_parallel(module, config, shard)
        model, named, clip = split.model, split.named, split.clip_
        state_dict = lambda _module: split.state()  # noqa: E731
    elif grouped and config.fsdp:
        model = _fully_shard(module, config)  # module itself, sharded in place
        state_dict = _full_state_dict
    elif grouped:
        if config.sync_batchnorm:
            module = convert_sync_batchnorm(module, config.device)
        # Buffers at their default: rank 0's buffers (BatchNorm's running statistics)
        # are broadcast at the start of every forward, no_sync ones too. Not spelled
        # out: torch 2.13 deprecates broadcast_buffers= (a FutureWarning per rank)
        # for forward_sync_buffers=, which older versions lack; the default is both.
        model = DDP(
            module,
            device_ids=[device] if config.device == "cuda" else None,
            find_unused_parameters=config.find_unused_parameters,
        )
        if config.comm_hook is not None:
            register_comm_hook(model, config.comm_hook, config.device)
    if named is None:
        named = list(module.named_parameters())
    optimizer = build_optimizer(named, config.optimizer, zero=config.zero)
    scheduler = None
    if config.lr_scheduler is not None:
        scheduler = scheduler_factory(config.lr_scheduler)(optimizer)
    # The tp ranks of a data rank read its shard (the mesh's tp dimension is innermost).
    sampler, loader = _loader(
        config, data, dtype, rank=rank // config.tp, world_size=world_size // config.tp
    )
    result = Result(states=[], losses=[], final={})
    for window in _windows(config, sampler, loader):
        loss = train_window(config, model, optimizer, window, device, clip=clip)
        if scheduler is not None:
            scheduler.step()  # after optimizer.step(), as torch's docs order them
        if grouped:  # for logging only: the mean over ranks, one all_reduce after the step
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            loss /= world_size
        result.losses.append(loss.item())
        state = state_dict(module) if rank == 0 or collective else None
        if rank == 0:
            result.states.append(state)
        if len(result.losses) == config.max_steps:
            break
    final = state_dict(module) if rank == 0 or collective else None
    if rank == 0:
        result.final = final
    held = (
        optimizer_state_bytes(optimizer.optim if config.zero else optimizer),
        sum(local_bytes(p) for _, p in named),
    )
    counts = [held] * world_size
    if grouped:  # every rank's own counts
        dist.all_gather_object(counts, held)
    result.optimizer_state_bytes = [c[0] for c in counts]
    result.parameter_bytes = [c[1] for c in counts]
    return result


def _fully_shard(module: torch.nn.Module, config: TrainConfig, mesh: Any = None) -> torch.nn.Module:
    """FSDP2 as its docs apply it: ``fully_shard`` on every block of each
    ``nn.ModuleList`` (one all-gather and one reduce-scatter per block), then on the
    root (the remaining parameters, one group), over ``mesh`` (None: ``config``'s FSDP
    or HSDP mesh). Returns ``module``, sharded in place."""
    # Imported here: the DDP runs never need them, and DTensor takes seconds to import.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        names = ("replicate", "shard") if len(config.mesh_shape) == 2 else None
        mesh = init_device_mesh(config.device, config.mesh_shape, mesh_dim_names=names)
    for child in module.modules():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                fully_shard(block, mesh=mesh)
    return fully_shard(module, mesh=mesh)


def _full_state_dict(module: torch.nn.Module) -> State:
    """``numpy_state_dict`` of an FSDP2 module: every sharded tensor (a DTensor)
    gathered whole with ``full_tensor()``, a collective that every rank must join."""
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().numpy().copy()
        for k, v in module.state_dict().items()
    }


Batch = list[torch.Tensor]


def _loader(
    config: TrainConfig, data: Data, dtype: torch.dtype, *, rank: int, world_size: int
) -> tuple[DistributedSampler, DataLoader]:
    """This rank's sampler and loader; floating arrays are cast to ``dtype``."""
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in data]
    tensors = [t.to(dtype) if t.is_floating_point() else t for t in tensors]
    dataset = TensorDataset(*tensors)
    sampler = DistributedSampler(
        dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=config.shuffle,
        seed=config.seed,
        drop_last=config.drop_last,
    )
    # drop_last=True here: a rank's partial micro-batch is dropped, never padded.
    loader = DataLoader(
        dataset, batch_size=config.micro_batch_size, sampler=sampler, drop_last=True
    )
    return sampler, loader


def _windows(
    config: TrainConfig, sampler: DistributedSampler, loader: DataLoader
) -> Iterator[list[Batch]]:
    """The accumulation windows of all epochs, in order: ``accum_steps`` micro-batches
    each, and an epoch's incomplete last window only under ``last_window="step"``."""
    for epoch in range(config.epochs):
        sampler.set_epoch(epoch)  # reshuffles: epoch e uses the permutation of seed + e
        window: list[Batch] = []
        for batch in loader:
            window.append(batch)
            if len(window) == config.accum_steps:
                yield window
                window = []
        if window and config.last_window == "step":
            yield window


def train_window(
    config: TrainConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    window: list[Batch],
    device: torch.device,
    *,
    clip: Any = None,
) -> torch.Tensor:
    """One optimizer step on a window of ``k`` micro-batches, as DDP with gradient
    accumulation is written: ``loss / k`` and ``backward`` per micro-batch (under DDP
    inside ``no_sync`` for all but the last, so one all-reduce per step; under FSDP2
    with ``set_requires_gradient_sync`` true only for the last), the gradient clip if
    configured (``clip(max_grad_norm)`` where given, else ``clip_grad_norm_`` on
    ``model.parameters()``), ``optimizer.step()``, ``zero_grad``. Returns
    ``sum_j loss_j / k`` (this rank's; a tensor, not synchronized).
    ``loss_reduction="weighted"``: the backward of ``loss_sum_j * W / count``
    (``count`` over the window and every rank, counted first), and returns
    ``W * sum_j loss_sum_j / count``, whose mean over the ranks is the window's
    token-weighted loss."""
    k = len(window)
    total = torch.zeros((), dtype=torch_dtype(config.dtype), device=device)
    weighted = config.loss_reduction == "weighted"
    world = dist.get_world_size() if dist.is_initialized() else 1
    if weighted:
        count = _window_count(config, model, window, device)
    for j, (x, y) in enumerate(window):
        # Only the window's last backward all-reduces; the others accumulate
        # locally, so no_sync() must cover forward AND backward.
        sync = j == k - 1 or not isinstance(model, DDP)
        if config.fsdp:  # FSDP2's no_sync; the model is an FSDPModule
            model.set_requires_gradient_sync(j == k - 1)
        with nullcontext() if sync else model.no_sync():
            if weighted:
                loss_sum, _ = _micro_loss(config, model, x.to(device), y.to(device))
                loss = loss_sum * world / count
            else:
                loss = _micro_loss(config, model, x.to(device), y.to(device)) / k
            loss.backward()
        total += loss.detach()
    if config.optimizer.max_grad_norm is not None and clip is not None:
        clip(config.optimizer.max_grad_norm)
    elif config.optimizer.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def _window_count(
    config: TrainConfig, model: torch.nn.Module, window: list[Batch], device: torch.device
) -> torch.Tensor:
    """The items a weighted loss counts over the window, summed over every rank: a
    forward without gradients in eval mode (no dropout draws, no running statistics
    moved), then one ``all_reduce``."""
    count = torch.zeros((), dtype=torch_dtype(config.dtype), device=device)
    training = model.training
    model.eval()
    with torch.no_grad():
        for x, y in window:
            count += _micro_loss(config, model, x.to(device), y.to(device))[1]
    model.train(training)
    if dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
    return count


def _build(config: TrainConfig) -> torch.nn.Module:
    """The model of ``config`` in its dtype (its weights are replaced by the job's state)."""
    dtype = torch_dtype(config.dtype)
    if is_user_model(config.model):
        return build_user_model(config.model, seed=config.seed, dtype=dtype)
    return build_model(config.model, dtype=dtype)


def _micro_loss(
    config: TrainConfig, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """The loss of one micro-batch: the reference model's, or ``config.loss(model(x), y)``."""
    if config.loss is None:
        return compute_loss(config.model, model, x, y)
    return loss_function(config.loss)(model(x), y)


def _run_rank_jobs(rank: int, world_size: int, jobs: Sequence[Job]) -> list[Result]:
    """Every job on this rank of an initialized process group, each with a fresh model
    (DDP, or FSDP2 under ``fsdp``)."""
    return [_run(*job, rank=rank, world_size=world_size, grouped=True) for job in jobs]

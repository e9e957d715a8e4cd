"""Parity runner: jaxdp and torch_ref (PyTorch DDP + GA) on the same weights, data and order.

Both sides start from one torch initialization (converted with
:func:`torch_to_params`), read the same arrays in the order of torch's own
``DistributedSampler`` (its ``randperm``), and use the same hyper-parameters;
weights and losses are compared after every optimizer step. ``torch`` and
``torch_ref`` are imported only when a run starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from .._layout import (
    BatchSizes,
    LastWindow,
    batch_sizes,
    epoch_schedule,
    micro_batches,
    process_share,
)
from .._mesh import data_mesh
from .._model_state import batch_norm_modules
from .._options import AccumulationPath, Parallel, Skips, Strategy
from .._sampler import Permutation
from .._step import make_train_step
from ..models import MODEL_AXIS, MODELS, TENSOR_PARALLEL, TRAINABLE, build_model, model_loss
from ..testing._tolerances import tolerances
from ._convert import params_to_torch, torch_to_params
from ._locate_text import Divergence
from ._main_guard import check_main_guard
from ._optim import OPTIMIZERS, OptimizerSpec, optax_like_torch

Dtype = Literal["float32", "float64"]


# Models with a branch some steps leave unused on every rank: torch_ref runs DDP with
# find_unused_parameters=True, and jaxdp with skip_unused=True (torch skips the update
# of a parameter whose .grad is None).
UNUSED_BRANCH = frozenset({"embed_branch"})

# Allowed |jaxdp - torch| <= ATOL + RTOL * |torch|, elementwise, per dtype: the
# "torch_trajectory" rows of the one tolerance table, each with its reason there.
RTOL = {dtype: tol.rtol for dtype, tol in tolerances("torch_trajectory").items()}
"""Parity's relative tolerance per dtype: ``|jaxdp - torch| <= ATOL + RTOL * |torch|``."""
ATOL = {dtype: tol.atol for dtype, tol in tolerances("torch_trajectory").items()}
"""Parity's absolute floor per dtype, for elements that pass near zero."""


@dataclasses.dataclass(frozen=True)
class ParityConfig:
    """One comparison; the batch identity is ``num_devices * accum_steps * micro_batch_size``."""

    model: str = "mlp"  # linear, mlp, cnn, transformer, cnn_bn, embed_branch, stack
    optimizer: str | OptimizerSpec = "adamw"  # a key of OPTIMIZERS, or a spec
    num_devices: int = 2  # jaxdp devices == torch DDP ranks
    accum_steps: int = 2
    micro_batch_size: int = 4
    steps: int = 10  # optimizer steps compared
    dtype: Dtype = "float64"
    path: AccumulationPath = "fused"
    strategy: Strategy = "shard_map"
    num_samples: int = 96  # synthetic data set size (epochs repeat as needed)
    last_window: LastWindow = "drop"
    shuffle: bool = True
    seed: int = 0  # weights and data; the sampler uses seed + epoch
    sync_batchnorm: bool = False  # cnn_bn: SyncBatchNorm / batch_stats="sync" (else DDP's)
    torch_device: Literal["cpu", "cuda"] = "cpu"  # cuda: nccl, one GPU per rank, TF32 off
    # jaxdp's Parallel(zero_stage=..., shards=...) against its torch counterpart: stages 1
    # and 2 ZeroRedundancyOptimizer on DDP, stage 3 FSDP2 (shards < num_devices: HSDP).
    zero_stage: int = 0
    shards: int | None = None
    # Stage 3: what jaxdp's layer loop keeps for the backward (Parallel(remat=...)): "dots",
    # "full" or the name of a jax.checkpoint_policies policy. Torch's FSDP2 keeps every
    # activation: the remat changes which values are recomputed, never what they are.
    remat: str = "dots"
    # compare_models: "weighted", a loss of (loss_sum, count) normalized by the global count
    # (jaxdp's loss_reduction="weighted"; torch_ref's num_items_in_batch recipe).
    loss_reduction: Literal["mean", "weighted"] = "mean"
    # The torch side: torch_ref's loop, or a team's own script as its torch_ref.Recorder
    # recorded it (compare_recorded; nothing of torch runs but the divergence locator).
    torch_side: Literal["torch_ref", "recorded"] = "torch_ref"
    # Tensor parallelism over a model axis of tp devices beside the num_devices data
    # ranks: jaxdp on a (data, model) mesh with the model's Megatron plan in its metadata
    # (Parallel(model_axes=("model",))), torch_ref's TP x DDP or TP x FSDP2 on tp ranks
    # per data rank. 1: none.
    tp: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ValueError(f"tp={self.tp!r} must be a positive integer (1: no model axis)")
        if self.tp > 1 and self.model not in TENSOR_PARALLEL:
            raise ValueError(
                f"tp={self.tp} needs a model with a tensor-parallel plan {TENSOR_PARALLEL}, "
                f"got model={self.model!r}"
            )


@dataclasses.dataclass
class Trajectory:
    """Weights (torch state_dict layout) and loss after every optimizer step."""

    states: list[dict[str, np.ndarray]]
    losses: list[float]


@dataclasses.dataclass
class ParityReport:
    """The comparison of one jaxdp run with its torch_ref twin, step by step.

    Differences are elementwise over each parameter (in torch's state_dict
    layout for the reference models, in the JAX model's layout under its names
    for :func:`compare_models`); a step passes when every element satisfies
    ``|jaxdp - torch| <= atol + rtol * |torch|`` and so does the loss.
    """

    config: ParityConfig
    rtol: float
    atol: float
    max_abs: list[dict[str, float]]  # per step, per parameter
    max_rel: list[dict[str, float]]
    loss_diff: list[float]  # per step, |jaxdp - torch|
    first_failure: int | None  # first step (1-based) beyond tolerance, None if none
    divergence: Divergence | None = None  # compare_models' divergence locator, when it ran

    @property
    def passed(self) -> bool:
        return self.first_failure is None


def torch_config(config: ParityConfig, **overrides: Any) -> Any:
    """The ``torch_ref.TrainConfig`` that mirrors ``config``; ``overrides`` set other
    fields (``model`` and ``loss`` for a user's model)."""
    import torch_ref

    fields = dict(
        model=config.model,
        optimizer=torch_ref.OptimConfig(**dataclasses.asdict(spec_of(config))),
        micro_batch_size=config.micro_batch_size,
        num_devices=config.num_devices,
        accum_steps=config.accum_steps,
        epochs=_epochs_needed(config),
        max_steps=config.steps,
        shuffle=config.shuffle,
        seed=config.seed,
        last_window=config.last_window,
        dtype=config.dtype,
        device=config.torch_device,
        sync_batchnorm=config.sync_batchnorm,
        find_unused_parameters=config.model in UNUSED_BRANCH,
        loss_reduction=config.loss_reduction,
    )
    if config.zero_stage in (1, 2):
        fields["zero"] = True
    elif config.zero_stage == 3:
        fields.update(fsdp=True, shards=config.shards)
    if config.tp > 1:  # tp ranks per data rank; FSDP2 over the data ranks at stages 1 to 3
        fields.update(num_devices=config.num_devices * config.tp, tp=config.tp)
        if config.zero_stage:
            fields.update(zero=False, fsdp=True)
    return torch_ref.TrainConfig(**{**fields, **overrides})


def torch_inputs(config: ParityConfig) -> tuple[tuple[np.ndarray, np.ndarray], dict]:
    """The shared data set and torch's initial state_dict (numpy)."""
    import torch_ref

    model = torch_ref.build_model(config.model, seed=config.seed, dtype=config.dtype)
    initial = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    data = torch_ref.make_data(
        config.model, config.num_samples, seed=config.seed, dtype=config.dtype
    )
    return data, initial


def run_torch(config: ParityConfig, data: Any, initial: dict) -> Trajectory:
    """torch_ref: one process with GA for one device, real DDP processes otherwise."""
    import torch_ref

    if config.num_devices == 1:
        result = torch_ref.train_ga(torch_config(config), data, initial)
    else:
        result = torch_ref.train_ddp(torch_config(config), data, initial)
    return Trajectory(result.states, list(result.losses))


def run_jaxdp(
    config: ParityConfig,
    data: Any,
    initial: dict,
    *,
    permutation: Permutation | None = None,
    **options: Any,
) -> Trajectory:
    """jaxdp on ``num_devices`` devices, in torch's data order, from torch's weights.

    ``options`` override the :func:`make_train_step` options the model implies.

    ``permutation`` replaces ``torch_ref.torch_permutation`` (e.g. a table of
    torch's orders, so a process need not import torch). On a mesh spanning
    several processes (after :func:`initialize`) each process reads only the
    rows of its devices (:func:`process_share`). float32 matmuls run at full
    precision (no TF32 or bf16 passes on GPUs), as torch_ref sets on its side.
    """
    if permutation is None:
        import torch_ref

        permutation = torch_ref.torch_permutation
    with jax.default_matmul_precision("highest"):
        return _run_jaxdp(config, data, initial, permutation, options)


def _run_jaxdp(
    config: ParityConfig,
    data: Any,
    initial: dict,
    permutation: Permutation,
    options: dict[str, Any],
) -> Trajectory:
    model = build_model(config.model, param_dtype=jnp.dtype(config.dtype), tp=config.tp > 1)
    mesh = data_mesh(config.num_devices)
    if config.tp > 1:  # the data ranks' devices, each with tp of the model axis
        auto = (jax.sharding.AxisType.Auto,) * 2
        devices = np.array(jax.devices()[: config.num_devices * config.tp])
        mesh = jax.sharding.Mesh(
            devices.reshape(config.num_devices, config.tp), ("data", MODEL_AXIS), axis_types=auto
        )
    batch_stats = None
    if batch_norm_modules(model):
        batch_stats = "sync" if config.sync_batchnorm else "local"
    step = make_train_step(
        model_loss(config.model),
        optax_like_torch(spec_of(config)),
        mesh=mesh,
        accum_steps=config.accum_steps,
        path=config.path,
        batch_stats=batch_stats,
        trainable=TRAINABLE.get(config.model),
        # torch's optimizers skip the parameters DDP leaves without a gradient.
        **with_groups(
            options,
            strategy=config.strategy,
            unused=config.model in UNUSED_BRANCH,
            zero_stage=config.zero_stage,
            shards=config.shards,
            remat=config.remat,
            model_axes=(MODEL_AXIS,) if config.tp > 1 else (),
        ),
    )
    # torch_ref's models are nn.Linear and nn.Conv layers: [out, in, *k].
    state = step.init(torch_to_params(initial, model, layouts="out_in"))
    # Written back under torch's keys: a stack of layers (stack's blocks) as its
    # nn.ModuleList's blocks.0, blocks.1, ...
    return train_steps(
        config, step, state, data, permutation, lambda m: params_to_torch(m, initial)
    )


def remat_policy(name: str) -> Any:
    """``Parallel.remat`` of a name: ``"dots"``, ``"full"``, or the name of a
    ``jax.checkpoint_policies`` policy (e.g. ``"dots_with_no_batch_dims_saveable"``)."""
    if name in ("dots", "full"):
        return name
    policy = getattr(jax.checkpoint_policies, name, None)
    if not callable(policy) or name.startswith("_") or name.startswith("save_"):
        usable = sorted(
            n
            for n in dir(jax.checkpoint_policies)
            if n.endswith(("saveable", "_dots")) and not n.startswith("_")
        )
        raise ValueError(
            f"remat={name!r} must be 'dots', 'full' or the name of a "
            f"jax.checkpoint_policies policy: {', '.join(usable)}"
        )
    return policy


def with_groups(
    options: dict[str, Any],
    *,
    strategy: Strategy,
    unused: bool | None = None,
    zero_stage: int = 0,
    shards: int | None = None,
    remat: str = "dots",
    model_axes: tuple[str, ...] = (),
) -> dict[str, Any]:
    """:func:`jaxdp.make_train_step`'s keywords: ``options`` with the option groups the
    comparison implies where they give none, ``Parallel(strategy=strategy,
    zero_stage=zero_stage, shards=shards, remat=remat, model_axes=model_axes)`` (remat at
    stage 3 only, a
    ``jax.checkpoint_policies`` name resolved) and (if ``unused`` is set)
    ``Skips(unused=unused)``. A group given is taken whole."""
    out = dict(options)
    if out.get("parallel") is None:
        stage_3 = {"remat": remat_policy(remat)} if zero_stage == 3 else {}
        out["parallel"] = Parallel(
            strategy=strategy,
            zero_stage=zero_stage,
            shards=shards,
            model_axes=model_axes,
            **stage_3,
        )
    if unused is not None and out.get("skips") is None:
        out["skips"] = Skips(unused=unused)
    return out


def train_steps(
    config: ParityConfig,
    step: Any,
    state: Any,
    data: Any,
    permutation: Permutation,
    snapshot: Callable[[Any], dict[str, np.ndarray]],
) -> Trajectory:
    """``config.steps`` optimizer steps of ``step`` in torch's data order; ``snapshot``
    turns the trained model (``step.model(state)``) into the compared arrays."""
    share = process_share(step.mesh, sizes_of(config), model_axes=step.options.model_axes)
    states, losses = [], []
    for batch, weights in step_batches(config, data, permutation, share.rows):
        if config.path == "fused":
            state, metrics = step(state, batch, weights)
        else:
            for micro, weight in zip(micro_batches(batch, share.sizes), weights, strict=True):
                state, metrics = step(state, micro, weight)
        states.append(snapshot(step.model(state)))
        losses.append(float(metrics["loss"]))
    return Trajectory(states, losses)


def compare(
    config: ParityConfig,
    jaxdp_run: Trajectory,
    torch_run: Trajectory,
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> ParityReport:
    """Elementwise differences after every step; the dtype's tolerances by default."""
    rtol = RTOL[config.dtype] if rtol is None else rtol
    atol = ATOL[config.dtype] if atol is None else atol
    if len(jaxdp_run.states) != len(torch_run.states):
        raise ValueError(
            f"jaxdp made {len(jaxdp_run.states)} optimizer steps, torch_ref "
            f"{len(torch_run.states)}: the runs do not describe the same training"
        )
    max_abs, max_rel, loss_diff, first = [], [], [], None
    for i, (ours, theirs) in enumerate(zip(jaxdp_run.states, torch_run.states, strict=True)):
        if ours.keys() != theirs.keys():
            raise ValueError(f"parameter names differ: {sorted(ours)} vs {sorted(theirs)}")
        abs_, rel, ok = {}, {}, True
        for name, b in theirs.items():
            a, b = np.asarray(ours[name], np.float64), np.asarray(b, np.float64)
            diff = np.abs(a - b)
            abs_[name] = float(diff.max(initial=0.0))
            rel[name] = float((diff / np.maximum(np.abs(b), np.finfo(np.float64).tiny)).max())
            ok &= bool(np.all(diff <= atol + rtol * np.abs(b)))
        a, b = jaxdp_run.losses[i], torch_run.losses[i]
        loss_diff.append(abs(a - b))
        ok &= abs(a - b) <= atol + rtol * abs(b)
        max_abs.append(abs_)
        max_rel.append(rel)
        if not ok and first is None:
            first = i + 1
    return ParityReport(config, rtol, atol, max_abs, max_rel, loss_diff, first)


def run_parity(config: ParityConfig) -> ParityReport:
    """Trains both sides and compares them after every optimizer step."""
    check_config(config)
    if config.num_devices > 1:
        check_main_guard(f"run_parity(num_devices={config.num_devices})")
    data, initial = torch_inputs(config)
    return compare(config, run_jaxdp(config, data, initial), run_torch(config, data, initial))


def sizes_of(config: ParityConfig) -> BatchSizes:
    return batch_sizes(
        num_devices=config.num_devices,
        accum_steps=config.accum_steps,
        micro_batch_size=config.micro_batch_size,
    )


def _epochs_needed(config: ParityConfig) -> int:
    # The number of steps per epoch does not depend on the order.
    schedule = epoch_schedule(
        config.num_samples, sizes_of(config), shuffle=False, last_window=config.last_window
    )
    return -(-config.steps // len(schedule.rows))


def step_batches(
    config: ParityConfig, data: Any, permutation: Permutation, rows: slice
) -> Iterator[tuple[Any, Any]]:
    """``(batch, micro_weights)`` of the first ``config.steps`` optimizer steps: the
    ``rows`` of each global batch (a process's share)."""
    done, epoch = 0, 0
    while True:
        schedule = epoch_schedule(
            config.num_samples,
            sizes_of(config),
            epoch=epoch,
            shuffle=config.shuffle,
            seed=config.seed,
            permutation=permutation,
            last_window=config.last_window,
        )
        for order, weights in zip(schedule.rows, schedule.micro_weights, strict=True):
            if done == config.steps:
                return
            yield jax.tree.map(lambda x, mine=order[rows]: x[mine], data), weights
            done += 1
        epoch += 1


def spec_of(config: ParityConfig) -> OptimizerSpec:
    if isinstance(config.optimizer, OptimizerSpec):
        return config.optimizer
    return OPTIMIZERS[config.optimizer]


def check_config(config: ParityConfig) -> None:
    if not isinstance(config.optimizer, OptimizerSpec) and config.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={config.optimizer!r} must be one of {sorted(OPTIMIZERS)}")
    if config.dtype not in RTOL:
        raise ValueError(f"dtype={config.dtype!r} must be one of {sorted(RTOL)}")
    if config.steps < 1:
        raise ValueError(f"steps={config.steps} must be at least 1")
    if config.torch_device not in ("cpu", "cuda"):
        raise ValueError(f"torch_device={config.torch_device!r} must be 'cpu' or 'cuda'")
    if config.sync_batchnorm and config.model != "cnn_bn":
        raise ValueError(
            f"sync_batchnorm=True needs a model with BatchNorm (cnn_bn), got {config.model!r}"
        )
    if config.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={config.zero_stage!r} must be 0, 1, 2 or 3")
    if config.shards is not None and config.zero_stage != 3:
        raise ValueError(
            f"shards={config.shards} needs zero_stage=3 (HSDP: parameters split within "
            f"groups of shards devices), got zero_stage={config.zero_stage}"
        )
    if config.shards is not None and (config.shards < 1 or config.num_devices % config.shards):
        raise ValueError(
            f"shards={config.shards} must divide num_devices={config.num_devices} "
            "(num_devices // shards replica groups of shards devices)"
        )
    if config.torch_side not in ("torch_ref", "recorded"):
        raise ValueError(f"torch_side={config.torch_side!r} must be 'torch_ref' or 'recorded'")
    if config.loss_reduction not in ("mean", "weighted"):
        raise ValueError(f"loss_reduction={config.loss_reduction!r} must be 'mean' or 'weighted'")
    if config.loss_reduction == "weighted" and config.model in MODELS:
        raise ValueError(
            "loss_reduction='weighted' needs a loss of your own returning (loss_sum, count): "
            f"compare_models, not the reference model {config.model!r}"
        )
    if config.model in MODELS and spec_of(config).groups:
        raise ValueError(
            f"optimizer.groups name torch's parameters, and the reference model "
            f"{config.model!r} is compared under its own names: parameter groups are for "
            "your models (compare_models, compare_recorded; jaxdp parity --torch-model)"
        )
    # jaxdp's own rules for the layout (pmap is stage 0 only, shards=1 is DDP), before
    # either side trains.
    stage_3 = {"remat": remat_policy(config.remat)} if config.zero_stage == 3 else {}
    Parallel(
        strategy=config.strategy, zero_stage=config.zero_stage, shards=config.shards, **stage_3
    )
    if config.remat != "dots" and config.zero_stage != 3:
        raise ValueError(
            f"remat={config.remat!r} needs zero_stage=3 (what the layer loop keeps while the "
            f"parameters are gathered a layer at a time), got zero_stage={config.zero_stage}"
        )
    if config.torch_device == "cuda":
        check_torch_gpus(config.num_devices)
    if config.dtype == "float64" and not jax.config.jax_enable_x64:
        raise ValueError("dtype='float64' needs jax_enable_x64 (set it before creating arrays)")


def check_torch_gpus(num_devices: int) -> None:
    """Raises ValueError unless torch sees a GPU for each of ``num_devices`` ranks."""
    import torch

    visible = torch.cuda.device_count()
    if visible < num_devices:
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ValueError(
            f"torch_device='cuda' needs one GPU per rank: num_devices={num_devices}, and torch "
            f"{torch.__version__} ({build}) sees {visible}; use torch_device='cpu'"
        )

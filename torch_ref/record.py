"""A team's own torch training script, recorded for jaxdp's comparison with its JAX port.

The script keeps its loop, its launcher (``torchrun``, ``mp.spawn``, one process) and
its data; it creates a :class:`Recorder` once its model and optimizer exist, hands it
each micro-batch it trains on and each optimizer step's loss, and rank 0 writes a
:class:`Record`: the weights before the first step and after every step, the step's
loss, every rank's micro-batches in the order they were trained, the optimizer in
torch_ref's terms (its parameter groups included) and the learning rate each group
stepped with. ``jaxdp.parity.compare_recorded`` (``jaxdp parity --torch-record``)
trains the JAX port on those batches from those weights and compares step by step, the
divergence locator included::

    recorder = torch_ref.Recorder(model, optimizer)  # model: the DDP module or its own
    for step in range(steps):
        total = 0.0
        for j, (x, y) in enumerate(window):
            with model.no_sync() if j < K - 1 else nullcontext():
                loss = loss_fn(model(x), y) / K
                loss.backward()
            recorder.micro_batch(x, y)
            total += loss.item()
        optimizer.step()
        scheduler.step()
        recorder.step(total)  # after optimizer.step(); a collective: every rank calls it
        optimizer.zero_grad()
    recorder.save()  # rank 0 writes; path= or $TORCH_REF_RECORD

Never imports jaxdp or jax.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .models import numpy_state_dict
from .optim import OptimConfig, ParamGroup

RECORD_ENV = "TORCH_REF_RECORD"
"""The environment variable a :class:`Recorder` reads its path from when given none
(``jaxdp parity --torch-script`` sets it)."""

State = dict[str, np.ndarray]


@dataclasses.dataclass
class Record:
    """What a :class:`Recorder` wrote: one run of a team's script, as rank 0 saw it.

    Attributes:
      num_devices: the ranks (``dist.get_world_size()``, 1 without a process group).
      accum_steps: micro-batches per optimizer step on each rank (the same every step).
      micro_batch_size: rows of every micro-batch.
      dtype: the parameters' floating dtype (``"float64"``).
      initial: the ``state_dict`` (no ``module.`` prefix) when the recorder was created.
      states: the ``state_dict`` after every optimizer step.
      losses: per step, the mean over the ranks of the loss each gave ``step``.
      batches: per step ``(x, y)``, every rank's micro-batches of that step, rank-major
        (rank, micro-batch, row): ``num_devices * accum_steps * micro_batch_size`` rows.
      optimizer: torch's optimizer in torch_ref's terms, its groups after the first as
        ``ParamGroup``s of parameter names; the base rates (a scheduler's ``initial_lr``).
      rates: per step, the learning rate of each parameter group ``optimizer.step()``
        stepped with (after whatever scheduler the script has).
    """

    num_devices: int
    accum_steps: int
    micro_batch_size: int
    dtype: str
    initial: State
    states: list[State]
    losses: list[float]
    batches: list[tuple[np.ndarray, np.ndarray]]
    optimizer: OptimConfig
    rates: list[list[float]]

    def lr_scheduler(self, optimizer: torch.optim.Optimizer) -> RecordedRates:
        """A scheduler that gives ``optimizer``'s groups the recorded rates, step by step
        (the comparison replays torch's optimizer with it)."""
        return RecordedRates(optimizer, self.rates)


class RecordedRates:
    """Sets each group's ``lr`` to the recorded rate of step 1, then of the next step at
    every ``step()``, as the script's own scheduler did."""

    def __init__(self, optimizer: torch.optim.Optimizer, rates: list[list[float]]):
        self.optimizer, self.rates, self.done = optimizer, rates, 0
        self._set()

    def step(self) -> None:
        self.done += 1
        self._set()

    def _set(self) -> None:
        if self.done < len(self.rates):
            for group, rate in zip(self.optimizer.param_groups, self.rates[self.done], strict=True):
                group["lr"] = rate


def load_record(path: str | os.PathLike) -> Record:
    """The :class:`Record` a :class:`Recorder` saved at ``path``."""
    record = pickle.loads(Path(path).read_bytes())
    if not isinstance(record, Record):
        raise ValueError(f"{path} holds a {type(record).__name__}, not a torch_ref.Record")
    return record


class Recorder:
    """Records a team's own DDP (or one-process) training script for jaxdp's comparison.

    ``model``: the ``DistributedDataParallel`` module or the plain one; its module's
    ``state_dict`` is recorded now (the start) and after every step. ``optimizer``:
    ``torch.optim.AdamW``, ``torch.optim.SGD`` (dampening 0) or ``torch.optim.Adam``
    without weight decay (AdamW's twin), any number of parameter groups differing in
    ``lr`` and ``weight_decay`` (the other settings the same in every group); read now,
    and a hook on its ``step`` reads each group's rate as it steps. ``max_grad_norm``:
    the ``clip_grad_norm_`` the script applies before ``optimizer.step()`` (the recorder
    cannot see it). ``path``: where :meth:`save` writes (default ``$TORCH_REF_RECORD``).

    Call :meth:`micro_batch` with each micro-batch the script trains on, :meth:`step`
    after each ``optimizer.step()`` on every rank (it gathers every rank's batches and
    loss: a collective), then :meth:`save`; or use it as a context manager, which saves
    on a clean exit. Only rank 0 holds the record and writes it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None = None,
        path: str | os.PathLike | None = None,
    ):
        self.module = getattr(model, "module", model)  # DDP's wrapped module
        self.optimizer = optimizer
        self.path = path
        self.grouped = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.grouped else 0
        self.world_size = dist.get_world_size() if self.grouped else 1
        config = optim_config(self.module, optimizer, max_grad_norm)
        initial = numpy_state_dict(self.module)
        floating = sorted({str(v.dtype) for v in initial.values() if v.dtype.kind == "f"})
        if len(floating) != 1:
            raise ValueError(f"model holds floating tensors of {floating}; one dtype is needed")
        self.record = Record(
            num_devices=self.world_size,
            accum_steps=0,
            micro_batch_size=0,
            dtype=floating[0],
            initial=initial,
            states=[],
            losses=[],
            batches=[],
            optimizer=config,
            rates=[],
        )
        self.window: list[tuple[np.ndarray, np.ndarray]] = []
        self.stepped: list[float] | None = None
        self.hook = optimizer.register_step_pre_hook(self._read_rates)

    def _read_rates(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.stepped = [float(g["lr"]) for g in optimizer.param_groups]

    def micro_batch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One micro-batch this rank trains on (its forward and backward), in order."""
        self.window.append(tuple(t.detach().cpu().numpy().copy() for t in (x, y)))

    def step(self, loss: float | torch.Tensor) -> None:
        """After ``optimizer.step()``, on every rank: ``loss`` is this rank's part of the
        step's loss, the sum of the losses its backward passes ran on (``loss_j / K``; a
        token-weighted loss's ``loss_sum_j * world_size / count``): the mean over the
        ranks is the step's loss. Records the new weights, the loss, the window."""
        if self.stepped is None:
            raise RuntimeError(
                "Recorder.step() came before optimizer.step(): call it after each optimizer.step()"
            )
        if not self.window:
            raise RuntimeError("Recorder.step() with no micro_batch(x, y) since the last step")
        mine = (self.window, float(loss))
        gathered = [mine] * self.world_size
        if self.grouped:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, mine)
        rates, self.window, self.stepped = self.stepped, [], None
        if self.rank == 0:
            self._add(gathered, rates)

    def _add(self, gathered: list[Any], rates: list[float]) -> None:
        record = self.record
        windows = [window for window, _ in gathered]
        k, b = len(windows[0]), len(windows[0][0][0])
        record.accum_steps = record.accum_steps or k
        record.micro_batch_size = record.micro_batch_size or b
        sizes = [[len(x) for x, _ in window] for window in windows]
        want = [[record.micro_batch_size] * record.accum_steps] * len(windows)
        if sizes != want:
            raise ValueError(
                f"step {len(record.states) + 1}: the ranks' micro-batches have {sizes} rows, "
                f"and the comparison needs accum_steps={record.accum_steps} micro-batches of "
                f"micro_batch_size={record.micro_batch_size} rows on every rank every step"
            )
        rows = [micro for window in windows for micro in window]
        record.batches.append(tuple(np.concatenate([m[i] for m in rows]) for i in range(2)))
        record.losses.append(sum(loss for _, loss in gathered) / len(gathered))
        record.states.append(numpy_state_dict(self.module))
        record.rates.append(rates)

    def save(self, path: str | os.PathLike | None = None) -> Path | None:
        """Rank 0 writes the record (a pickle, read by ``load_record``) to ``path``,
        the recorder's, or ``$TORCH_REF_RECORD``; returns it (None on other ranks).
        Removes the hook on the optimizer. Called on every rank, it returns on each once
        rank 0 has written (a barrier, also when the write fails): a rank that went on to
        ``destroy_process_group`` and exited while rank 0 still wrote made gloo abort
        rank 0 ("terminate called without an active exception", seen 1 run in 3 on 2
        busy cores)."""
        self.hook.remove()
        target = path or self.path or os.environ.get(RECORD_ENV)
        if target is None:
            raise ValueError(f"Recorder.save() needs a path: path= or ${RECORD_ENV}")
        try:
            if self.rank == 0:  # it alone records the steps
                if not self.record.states:
                    raise ValueError(
                        "the recorder has no step to save: call step() after each step"
                    )
                Path(target).write_bytes(pickle.dumps(self.record))
        finally:
            if self.grouped and self.world_size > 1:
                dist.barrier()
        return Path(target) if self.rank == 0 else None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if kind is None:
            self.save()
        else:
            self.hook.remove()


# torch's optimizer classes and the settings each group must share, by torch_ref's name.
_SHARED = {
    "adamw": ("betas", "eps", "amsgrad", "maximize"),
    "sgd": ("momentum", "nesterov", "dampening", "maximize"),
}


def optim_config(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
) -> OptimConfig:
    """``optimizer`` in torch_ref's terms: its first group's settings, the others as
    ``ParamGroup``s of ``module``'s parameter names; refuses what has no optax twin."""
    kind = type(optimizer).__name__
    groups = optimizer.param_groups
    if kind == "Adam" and all(g["weight_decay"] == 0 for g in groups):
        kind = "AdamW"  # no decay: the same update
    name = {"AdamW": "adamw", "SGD": "sgd"}.get(kind)
    if name is None:
        raise ValueError(
            f"optimizer {kind} has no optax twin here: the recorder reads torch.optim.AdamW, "
            "torch.optim.SGD, and torch.optim.Adam without weight_decay"
        )
    first = groups[0]
    for i, g in enumerate(groups):
        for key in _SHARED[name]:
            if g.get(key) != first.get(key):
                raise ValueError(
                    f"param_groups[{i}] sets {key}={g.get(key)!r} and param_groups[0] "
                    f"{first.get(key)!r}: groups may differ in lr and weight_decay only"
                )
    for key, value in (("amsgrad", False), ("maximize", False), ("dampening", 0)):
        if first.get(key, value) != value:
            raise ValueError(f"{kind}({key}={first[key]!r}) has no optax twin here")
    names = {id(p): n for n, p in module.named_parameters()}
    unknown = [i for i, g in enumerate(groups) for p in g["params"] if id(p) not in names]
    if unknown:
        raise ValueError(
            f"param_groups[{unknown[0]}] holds a parameter the model has not: give the "
            "Recorder the model the optimizer updates"
        )

    def base(g: dict[str, Any]) -> float:
        return float(g.get("initial_lr", g["lr"]))  # a scheduler's base rate

    settings: dict[str, Any] = dict(
        learning_rate=base(first), weight_decay=float(first["weight_decay"])
    )
    if name == "adamw":
        settings.update(b1=first["betas"][0], b2=first["betas"][1], eps=first["eps"])
    else:
        settings.update(momentum=first["momentum"], nesterov=first["nesterov"])
    return OptimConfig(
        name,
        max_grad_norm=max_grad_norm,
        groups=tuple(
            ParamGroup(
                tuple(names[id(p)] for p in g["params"]),
                learning_rate=base(g),
                weight_decay=float(g["weight_decay"]),
            )
            for g in groups[1:]
        ),
        **settings,
    )


def record_script(
    script: str | os.PathLike,
    *,
    num_devices: int,
    path: str | os.PathLike,
    args: tuple[str, ...] = (),
) -> Record:
    """Runs a script that records itself with a :class:`Recorder` under ``torchrun
    --standalone --nproc-per-node num_devices SCRIPT ARGS`` with ``$TORCH_REF_RECORD``
    set to ``path``, and returns what rank 0 wrote there (``jaxdp parity
    --torch-script``). The script joins the process group itself (gloo on CPU)."""
    from ._launch import torchrun

    if not Path(script).is_file():
        raise ValueError(f"script={str(script)!r} is not a file")
    if not (isinstance(num_devices, int) and num_devices >= 1):
        raise ValueError(f"num_devices={num_devices!r} must be a positive integer")
    target = Path(path)
    target.unlink(missing_ok=True)
    torchrun(num_devices, [str(script), *args], env={RECORD_ENV: str(target)})
    if not target.is_file():
        raise RuntimeError(
            f"{script} ran under torchrun and wrote no record at {target}: it must create a "
            "torch_ref.Recorder and call its save() (or use it as a context manager)"
        )
    return load_record(target)

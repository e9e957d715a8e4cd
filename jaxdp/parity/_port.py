"""A user's torch model against their JAX port (Flax NNX, Flax Linen or equinox): resolved,
converted and trained side by side.

:func:`compare_models` is the entry point; :class:`Port` holds what it resolved before
anything runs (so a mapping error comes first), and its parts are what the tests batch.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen, nnx

from .._mesh import data_mesh
from .._model_kinds import as_trainable
from .._model_state import batch_norm_modules
from .._options import AccumulationPath
from .._sampler import Permutation
from .._step import make_train_step
from ._frameworks import LINEN, framework_of, train_mode
from ._mapping import Mapping_, WeightMap, build_weight_map, jax_leaves
from ._optim import OPTIMIZERS, OptimizerSpec, ParamGroup, optax_like_torch
from ._runner import (
    Dtype,
    ParityConfig,
    Trajectory,
    check_config,
    torch_config,
    train_steps,
    with_groups,
)

Loss = str | Callable[..., Any] | tuple[Any, Any]
"""``"mse"``, ``"cross_entropy"``, ``"MODULE:ATTR"`` (one function for both frameworks) or
``"MODULE:TORCH_ATTR,JAX_ATTR"``, a callable ``(output, y) -> scalar`` both frameworks run,
or a ``(torch_loss, jax_loss)`` pair (callables or specs)."""


def _jax_cross_entropy(out: jax.Array, y: jax.Array) -> jax.Array:
    logits = out.reshape(-1, out.shape[-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y.reshape(-1)).mean()


def _jax_mse(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(out - y))


JAX_LOSSES = {"cross_entropy": _jax_cross_entropy, "mse": _jax_mse}


@dataclasses.dataclass(frozen=True)
class Port:
    """One comparison, resolved: both models, the weight map, losses, optimizers, data."""

    config: ParityConfig  # the layout, steps, dtype, path; model is a label
    torch_model: Any  # what torch_ref builds in every rank: a spec, a callable or a module
    torch_loss: Any  # torch_ref's loss: a name, a spec or a callable
    jax_module: Any  # the port (NNX, bound Linen, equinox), with torch's initial weights
    jax_loss: Callable[[Any, Any], Any]  # (output, y) -> scalar
    jax_optimizer: optax.GradientTransformation
    spec: OptimizerSpec  # torch's optimizer
    weights: WeightMap
    data: tuple[np.ndarray, np.ndarray]  # floating arrays in config.dtype
    initial: dict[str, np.ndarray]  # torch's initial state_dict
    step_options: dict[str, Any]  # make_train_step's, for the JAX side
    torch_scheduler: Any = None  # torch_ref's lr_scheduler: optimizer -> LRScheduler
    # The rate (a number or an optax schedule) prepare built jax_optimizer with; None when
    # jax_optimizer is the user's own (the divergence locator then reads its state).
    learning_rate: Any = None
    # The data order (jaxdp's Permutation): None for torch's DistributedSampler's
    # randperm; a recorded run's own order (jaxdp.parity.compare_recorded).
    permutation: Permutation | None = None

    def order(self) -> Permutation:
        """The permutation both sides' samplers read the data in."""
        if self.permutation is not None:
            return self.permutation
        import torch_ref

        return torch_ref.torch_permutation

    def loss_fn(self, model: Any, batch: tuple[Any, Any]) -> jax.Array:
        """jaxdp's ``loss_fn(model, (x, y))``: one micro-batch's loss, from the port's
        training-mode output (:meth:`Framework.__call__`), of the form
        ``loss_reduction`` takes (checked while the step traces)."""
        out = self.jax_loss(self.weights.framework(model, batch[0]), batch[1])
        if not self.step_options.get("has_aux"):
            # The step's own reduction: step_options may set the port's otherwise.
            reduction = self.step_options.get("loss_reduction", self.config.loss_reduction)
            _check_loss_form(out, reduction, self.jax_loss)
        return out

    def torch_job(self) -> tuple[Any, tuple[np.ndarray, np.ndarray], dict[str, np.ndarray]]:
        """``(torch_ref.TrainConfig, data, initial_state)``: a job for ``torch_ref``."""
        config = torch_config(
            self.config,
            model=self.torch_model,
            loss=self.torch_loss,
            lr_scheduler=self.torch_scheduler,
        )
        return config, self.data, self.initial

    def step_kwargs(self) -> dict[str, Any]:
        """make_train_step's options: the configured strategy, BatchNorm as DDP's, torch's
        frozen tensors, the user's over them (``parallel=`` and ``skips=`` groups taken
        whole)."""
        kwargs: dict[str, Any] = {"loss_reduction": self.config.loss_reduction}
        stats = any(not leaf.param for leaf in self.weights.jax_leaves.values())
        if batch_norm_modules(self.jax_module) or (self.weights.framework is LINEN and stats):
            kwargs["batch_stats"] = "local"  # DDP's per-rank statistics, rank 0's buffers
        if self.weights.frozen:
            frozen = self.weights.frozen
            core_name = self.weights.framework.core_name
            kwargs["trainable"] = lambda path, value: core_name(".".join(path)) not in frozen
        return with_groups(
            {**kwargs, **self.step_options},
            strategy=self.config.strategy,
            zero_stage=self.config.zero_stage,
            shards=self.config.shards,
        )


def prepare(
    torch_model: Any,
    jax_model: Any,
    data: Any,
    *,
    loss: Loss,
    optimizer: str | OptimizerSpec,
    jax_optimizer: optax.GradientTransformation | None,
    mapping: Mapping_,
    step_options: Mapping[str, Any] | None,
    schedule: tuple[Any, Any] | None = None,
    initial: dict[str, np.ndarray] | None = None,
    permutation: Permutation | None = None,
    **layout: Any,
) -> Port:
    """Resolves and checks everything; ``layout`` holds :class:`ParityConfig`'s fields.
    ``initial``: torch's starting ``state_dict`` (a recorded run's: nothing is built in
    DDP ranks then) instead of the freshly built model's; ``permutation``: the data
    order instead of torch's randperm."""
    import torch_ref
    from torch_ref.user import build_user_model

    spec = _optimizer(optimizer)
    dtype = layout["dtype"]
    arrays = _data(data, dtype)
    config = ParityConfig(
        model=f"{_label(torch_model)} vs {_label(jax_model)}",
        optimizer=spec,
        num_samples=len(arrays[0]),
        **layout,
    )
    check_config(config)
    module = build_user_model(torch_model, seed=config.seed, dtype=_torch_dtype(dtype))
    built = torch_ref.numpy_state_dict(module)
    if initial is not None:
        _check_initial(initial, built)
    initial = built if initial is None else initial
    port_module = _jax_module(jax_model, config.seed, dtype, arrays[0][: config.micro_batch_size])
    weights = build_weight_map(module, port_module, mapping)
    torch_loss, jax_loss = _losses(loss)
    torch_scheduler, jax_schedule = _schedules(schedule, jax_optimizer, dtype)
    check_groups(spec, module)
    if config.num_devices > 1 and permutation is None:
        _check_picklable(torch_model=torch_model, loss=torch_loss, schedule=torch_scheduler)
    return Port(
        config=config,
        torch_model=torch_model,
        torch_loss=torch_loss,
        jax_module=weights.load(port_module, initial, jnp.dtype(dtype)),
        jax_loss=jax_loss,
        jax_optimizer=(
            optax_like_torch(port_spec(spec, weights), jax_schedule)
            if jax_optimizer is None
            else jax_optimizer
        ),
        spec=spec,
        weights=weights,
        data=arrays,
        initial=initial,
        step_options=dict(step_options or {}),
        torch_scheduler=torch_scheduler,
        learning_rate=(
            (spec.learning_rate if jax_schedule is None else jax_schedule)
            if jax_optimizer is None
            else None
        ),
        permutation=permutation,
    )


def _check_initial(initial: Mapping[str, Any], built: dict[str, np.ndarray]) -> None:
    """A given starting state_dict has the torch model's names and shapes."""
    given = {k: tuple(np.shape(v)) for k, v in initial.items()}
    expected = {k: v.shape for k, v in built.items()}
    if given != expected:
        missing, unexpected = sorted(expected.keys() - given), sorted(given.keys() - expected)
        shapes = {k: (given[k], expected[k]) for k in given.keys() & expected}
        raise ValueError(
            f"the recorded state_dict does not fit torch_model: missing {missing}, unexpected "
            f"{unexpected}, mis-shaped (recorded, built) "
            f"{ {k: v for k, v in shapes.items() if v[0] != v[1]} }"
        )


def check_groups(spec: OptimizerSpec, module: Any) -> None:
    """Every parameter a group of ``spec`` names is one of torch's."""
    names = [n for n, _ in module.named_parameters()]
    for i, group in enumerate(spec.groups):
        missing = [] if callable(group.params) else sorted(set(group.params) - set(names))
        if missing:
            raise ValueError(
                f"optimizer.groups[{i}] names {missing}, which torch_model has not; its "
                f"parameters: {names}"
            )


@dataclasses.dataclass(frozen=True)
class _TorchNamed:
    """A group's members on the port's side: the leaves whose torch tensor it holds."""

    group: ParamGroup
    weights: WeightMap

    def __call__(self, name: str) -> bool:
        torch_name = self.weights.torch_name(self.weights.framework.core_name(name))
        return torch_name is not None and self.group.holds(torch_name)


def port_spec(spec: OptimizerSpec, weights: WeightMap) -> OptimizerSpec:
    """``spec`` for the port's optimizer: its groups (torch's names) hold the port's leaves
    filled from the tensors they name, through the weight map."""
    if not spec.groups:
        return spec
    if weights.function is not None:
        raise ValueError(
            "optimizer.groups name torch's parameters, and a mapping function does not say "
            "which port leaf each fills: give a mapping dict, or the port's own jax_optimizer"
        )
    groups = tuple(dataclasses.replace(g, params=_TorchNamed(g, weights)) for g in spec.groups)
    return dataclasses.replace(spec, groups=groups)


def run_torch_port(port: Port) -> Any:
    """torch_ref's run (a ``torch_ref.Result``): in this process on one device, DDP
    processes on several."""
    import torch_ref

    job = port.torch_job()
    if port.config.num_devices == 1:
        return torch_ref.train_ga(*job)
    return torch_ref.train_ddp(*job)


def torch_trajectory(port: Port, result: Any) -> Trajectory:
    """torch_ref's states in the JAX layout, under the JAX names."""
    return Trajectory([port.weights.to_jax(s) for s in result.states], list(result.losses))


def _check_loss_form(out: Any, reduction: str, loss: Any) -> None:
    """A ``(loss_sum, count)`` pair under ``"weighted"``, anything else under ``"mean"``
    (the step checks that it is a scalar)."""
    name = getattr(loss, "__name__", None) or repr(loss)
    pair = isinstance(out, (tuple, list))
    if reduction == "mean" and pair:
        raise ValueError(
            f"loss {name} returns a {type(out).__name__} of {len(out)} values, and "
            "loss_reduction='mean' takes one scalar, a micro-batch's mean: a (loss_sum, count) "
            "loss needs loss_reduction='weighted' (jaxdp parity --loss-reduction weighted)"
        )
    if reduction == "weighted" and not (pair and len(out) == 2):
        shape = getattr(out, "shape", None)
        what = f"an array of shape {shape}" if shape is not None else f"a {type(out).__name__}"
        what = f"a {type(out).__name__} of {len(out)} values" if pair else what
        raise ValueError(
            f"loss {name} returns {what}, and "
            "loss_reduction='weighted' takes a (loss_sum, count) pair: a mean loss needs "
            "loss_reduction='mean' (the default)"
        )


def _jax_step(port: Port, config: ParityConfig) -> Any:
    return make_train_step(
        port.loss_fn,
        port.jax_optimizer,
        mesh=data_mesh(config.num_devices),
        accum_steps=config.accum_steps,
        path=config.path,
        **port.step_kwargs(),
    )


def trace_jax_port(port: Port) -> None:
    """Traces jaxdp's step on the port's first call, nothing allocated or run: a loss
    that does not return what ``loss_reduction`` takes (a ``(loss_sum, count)`` pair
    under ``"mean"``) raises the step's one-line error here, before torch trains."""
    config = port.config
    calls = config.accum_steps if config.path == "fused" else 1
    rows = config.num_devices * calls * config.micro_batch_size
    with jax.default_matmul_precision("highest"):
        step = _jax_step(port, config)
        step.trace(step.abstract_state(port.jax_module), tuple(a[:rows] for a in port.data))


def run_jax_port(port: Port, path: AccumulationPath | None = None) -> Trajectory:
    """jaxdp's step on the port, in torch's data order (``path`` overrides the config's)."""
    config = port.config if path is None else dataclasses.replace(port.config, path=path)
    with jax.default_matmul_precision("highest"):
        step = _jax_step(port, config)
        state = step.init(port.jax_module)
        return train_steps(config, step, state, port.data, port.order(), snapshot)


def snapshot(model: Any) -> dict[str, np.ndarray]:
    """Every parameter and batch statistic of a port, by dotted path (host copies)."""
    return {path: np.asarray(leaf.value) for path, leaf in jax_leaves(model).items()}


# ---- resolving the arguments ------------------------------------------------------------------


def _optimizer(optimizer: str | OptimizerSpec) -> OptimizerSpec:
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    if optimizer not in OPTIMIZERS:
        raise ValueError(
            f"optimizer={optimizer!r} must be an OptimizerSpec or one of {sorted(OPTIMIZERS)}"
        )
    return OPTIMIZERS[optimizer]


def _data(data: Any, dtype: Dtype) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` from a pair or a mapping with ``x`` and ``y`` (an ``.npz``); floating
    arrays cast to ``dtype``."""
    if isinstance(data, Mapping) or hasattr(data, "files"):
        missing = [k for k in ("x", "y") if k not in data]
        if missing:
            raise ValueError(f"data has no array {missing[0]!r}; it needs 'x' and 'y'")
        data = (data["x"], data["y"])
    if not (isinstance(data, (tuple, list)) and len(data) == 2):
        raise TypeError(f"data must be (x, y) or a mapping with 'x' and 'y', got {type(data)}")
    x, y = (np.asarray(a) for a in data)
    if len(x) != len(y):
        raise ValueError(f"data: x has {len(x)} rows but y has {len(y)}")
    return tuple(a.astype(dtype) if np.issubdtype(a.dtype, np.floating) else a for a in (x, y))


def _check_picklable(**torch_side: Any) -> None:
    """DDP ranks are processes of their own: what they build must travel by pickle."""
    for name, value in torch_side.items():
        try:
            pickle.dumps(value)
        except Exception as e:  # noqa: BLE001 - pickle raises several kinds
            raise ValueError(
                f"{name}={value!r} cannot reach the DDP ranks of num_devices > 1 ({e}); give "
                "a class or function defined at a module's top level, or a 'MODULE:ATTR' spec"
            ) from e


def _label(model: Any) -> str:
    if isinstance(model, str):
        return model.rpartition(":")[2]
    if isinstance(model, type) or inspect.isfunction(model):
        return model.__qualname__
    return type(model).__name__


def _torch_dtype(dtype: Dtype) -> Any:
    import torch

    return {"float32": torch.float32, "float64": torch.float64}[dtype]


def _jax_module(jax_model: Any, seed: int, dtype: Dtype, sample: np.ndarray) -> Any:
    """The port: a built model (NNX, bound Linen, equinox, or an unbound Linen module,
    initialized on ``sample`` and bound), or a class or factory called with
    ``rngs=nnx.Rngs(seed)``, ``key=jax.random.key(seed)`` and ``param_dtype=dtype`` for
    those it takes (``"MODULE:ATTR"`` names any of them)."""
    from torch_ref import load_attr

    if isinstance(jax_model, str):
        jax_model = load_attr(jax_model)
    built = framework_of(jax_model) is not None or isinstance(jax_model, linen.Module)
    if not built and callable(jax_model):
        given = {
            "rngs": nnx.Rngs(seed),
            "key": jax.random.key(seed),
            "param_dtype": jnp.dtype(dtype),
        }
        jax_model = jax_model(**{k: v for k, v in given.items() if k in _keywords(jax_model)})
    if isinstance(jax_model, linen.Module) and jax_model.scope is None:
        variables = jax_model.init(jax.random.key(seed), sample, **_init_mode(jax_model))
        jax_model = jax_model.bind(variables)
    framework = framework_of(jax_model)
    if framework is None:
        raise TypeError(
            f"jax_model gave {type(jax_model).__name__}, not an nnx.Module, a flax.linen "
            "Module or an equinox Module (or a class or factory returning one)"
        )
    as_trainable(jax_model)  # refuses what jaxdp's step cannot train (stateful equinox)
    if isinstance(jax_model, nnx.Module):
        _check_compute_dtypes(jax_model, dtype)
    return jax_model


def _init_mode(module: linen.Module) -> dict[str, bool]:
    # Initialized in inference mode: no dropout key is needed, BatchNorm creates its
    # statistics all the same.
    return {k: False for k in train_mode(module)}


def _keywords(factory: Any) -> set[str]:
    """The keyword arguments a class or factory (or a partial of one) still takes."""
    bound: set[str] = set()
    while isinstance(factory, functools.partial):
        bound |= set(factory.keywords)
        factory = factory.func
    # An NNX class's metaclass hides __init__'s signature.
    target = factory.__init__ if isinstance(factory, type) else factory
    return set(inspect.signature(target).parameters) - bound


def _check_compute_dtypes(module: nnx.Module, dtype: Dtype) -> None:
    """flax layers fix their compute dtype when built (nnx.Embed: its parameter's), so a
    port built in float32 computes in float32 whatever its weights become."""
    want = np.dtype(dtype)
    narrow = [
        f"{'.'.join(map(str, path)) or '<model>'} ({np.dtype(m.dtype).name})"
        for path, m in nnx.iter_modules(module)
        if _is_float(getattr(m, "dtype", None)) and np.dtype(m.dtype).itemsize < want.itemsize
    ]
    if narrow:
        raise ValueError(
            f"jax_model computes in a narrower dtype than dtype={dtype!r} in: "
            f"{', '.join(narrow)}; build the port with param_dtype=jnp.{dtype} (a factory "
            "taking param_dtype gets it) or compare in float32"
        )


def _is_float(value: Any) -> bool:
    try:
        return value is not None and np.issubdtype(np.dtype(value), np.floating)
    except TypeError:
        return False


def _losses(loss: Loss) -> tuple[Any, Callable[[Any, Any], Any]]:
    """``(torch_ref's loss, the JAX loss)``."""
    from torch_ref import load_attr

    if isinstance(loss, str) and loss in JAX_LOSSES:
        return loss, JAX_LOSSES[loss]
    if isinstance(loss, str):
        module, sep, attrs = loss.partition(":")
        torch_attr, _, jax_attr = attrs.partition(",")
        if not (sep and torch_attr):
            raise ValueError(
                f"loss={loss!r} must be one of {sorted(JAX_LOSSES)}, 'MODULE:ATTR' or "
                "'MODULE:TORCH_ATTR,JAX_ATTR'"
            )
        return f"{module}:{torch_attr}", load_attr(f"{module}:{jax_attr or torch_attr}")
    if isinstance(loss, tuple) and len(loss) == 2:
        jax_loss = load_attr(loss[1]) if isinstance(loss[1], str) else loss[1]
        return loss[0], jax_loss
    if callable(loss):
        return loss, loss
    raise TypeError(f"loss={loss!r} must be a name, a spec, a callable or a (torch, jax) pair")


def _schedules(
    schedule: tuple[Any, Any] | None, jax_optimizer: Any, dtype: Dtype
) -> tuple[Any, Any]:
    """``(torch_ref's lr_scheduler, the optax schedule or None)`` from ``schedule=``."""
    from torch_ref import load_attr
    from torch_ref.user import scheduler_factory

    if schedule is None:
        return None, None
    if not (isinstance(schedule, tuple) and len(schedule) == 2 and schedule[0] is not None):
        raise TypeError(
            f"schedule={schedule!r} must be a pair (torch's, optax's): a factory optimizer "
            "-> LRScheduler (or 'MODULE:ATTR'), and an optax schedule (or 'MODULE:ATTR'; None "
            "when jax_optimizer= holds it)"
        )
    torch_side, jax_side = schedule
    scheduler_factory(torch_side)  # refuses what is no factory
    if isinstance(jax_side, str):
        jax_side = load_attr(jax_side)
    if jax_side is not None and jax_optimizer is not None:
        raise ValueError(
            "schedule=(..., optax schedule) builds the port's optimizer, and jax_optimizer= "
            "is given too: give the schedule inside jax_optimizer and (torch's, None) here"
        )
    if jax_side is not None and dtype == "float64":
        rate = jnp.asarray(jax_side(jnp.zeros((), jnp.int32)))  # optax's count is int32
        if rate.dtype != jnp.float64:
            raise ValueError(
                f"the optax schedule returns {rate.dtype} for optax's int32 step count with "
                "dtype='float64': its learning rate is rounded to float32 (about 5e-8 "
                "relative, beyond float64's tolerance against torch). Compute it from a "
                "64-bit count, lambda count: schedule(jnp.asarray(count, jnp.int64)), or "
                "with float64 constants (jnp.float64(0.1)); the same in the port's own "
                "optimizer"
            )
    return torch_side, jax_side

"""``compare_models`` and ``assert_trains_like``: does a JAX port train like its torch model?"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import optax

from .._layout import LastWindow
from .._options import AccumulationPath, Strategy
from ._locate import locate as _locate
from ._main_guard import check_main_guard
from ._mapping import Mapping_
from ._optim import OptimizerSpec
from ._port import (
    Loss,
    Port,
    prepare,
    run_jax_port,
    run_torch_port,
    torch_trajectory,
    trace_jax_port,
)
from ._report import format_parity
from ._runner import Dtype, ParityReport, compare


def compare_models(
    torch_model: Any,
    jax_model: Any,
    data: Any,
    *,
    loss: Loss = "cross_entropy",
    optimizer: str | OptimizerSpec = "adamw",
    jax_optimizer: optax.GradientTransformation | None = None,
    mapping: Mapping_ = None,
    num_devices: int = 1,
    accum_steps: int = 2,
    micro_batch_size: int = 4,
    steps: int = 10,
    dtype: Dtype = "float64",
    path: AccumulationPath = "fused",
    strategy: Strategy = "shard_map",
    shuffle: bool = True,
    seed: int = 0,
    last_window: LastWindow = "drop",
    torch_device: str = "cpu",
    step_options: Mapping[str, Any] | None = None,
    locate: bool | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    loss_reduction: Literal["mean", "weighted"] = "mean",
    schedule: tuple[Any, Any] | None = None,
) -> ParityReport:
    """Trains a torch model (torch_ref: real DDP + ``no_sync`` + ``loss / accum_steps``)
    and its JAX port (jaxdp's step; Flax NNX, Flax Linen or equinox) from the same
    weights on the same data in the same order, and compares weights and loss after
    every optimizer step.

    ``torch_model``: an ``nn.Module`` (its weights are the start), a class or factory
    taking no arguments (built after ``torch.manual_seed(seed)``), or ``"MODULE:ATTR"``
    (MODULE a module name or a ``.py`` path). Several devices train in spawned
    processes, which import a class or factory by name (so it must live in an
    importable module, not in a test's or notebook's own namespace) or unpickle a module;
    they import the calling script again, so a script calls ``compare_models`` under
    ``if __name__ == "__main__":`` (a call outside it is refused before anything runs).
    ``jax_model`` (its structure; its values are replaced): an ``nnx.Module``; a Flax
    Linen module, bound (``module.bind(variables)``) or not (then initialized with
    ``jax.random.key(seed)`` on the first ``micro_batch_size`` rows of ``x``, in
    inference mode, and bound); an equinox module (stateless); a class or factory of
    any of them (called with ``rngs=nnx.Rngs(seed)``, ``key=jax.random.key(seed)``
    and ``param_dtype`` for those it takes); or ``"MODULE:ATTR"``. Both models take
    ``x`` and return the output the loss reads: an NNX port as ``model(x)``, a Linen
    port as ``model(x, train=True)`` if its ``__call__`` takes ``train`` (else
    ``model(x)``), an equinox port one example at a time (``jax.vmap(model)(x)``).

    ``data``: ``(x, y)`` arrays or a mapping with ``x`` and ``y`` (an ``.npz``);
    floating arrays become ``dtype`` on both sides. ``loss``: ``"cross_entropy"``
    (logits over the last axis, integer labels), ``"mse"``, a callable ``(output, y)
    -> scalar`` both frameworks run, a ``(torch_loss, jax_loss)`` pair, or
    ``"MODULE:ATTR"`` / ``"MODULE:TORCH_ATTR,JAX_ATTR"``: one micro-batch's mean,
    unscaled (torch_ref divides it by ``accum_steps``, jaxdp averages the window).
    ``optimizer``: torch's, as a :class:`OptimizerSpec` or a key of ``OPTIMIZERS``;
    ``jax_optimizer``: the port's optax optimizer (default
    ``optax_like_torch(optimizer)``). ``mapping`` converts the weights when names or
    layers differ: a dict ``{torch name: JAX path | (path or paths, transform) |
    None}`` overriding the automatic rules per tensor, or a function ``state_dict ->
    {JAX path: array}``; without one, names and standard layers decide (Linear,
    Conv1d/2d/3d, transformers' Conv1D, LayerNorm, GroupNorm, RMSNorm, Embedding,
    BatchNorm and its buffers, MultiheadAttention; flax's layouts for NNX and Linen,
    torch's for equinox), and a tensor tied to another (GPT-2's ``lm_head.weight``)
    may stay unmapped. JAX paths are dotted: an NNX attribute path, a Linen variable's path in
    its collection (``fc1.kernel``, ``bn.mean``), an equinox field path. Every
    unmapped, unused or mis-shaped parameter on either side is listed in one
    ``ValueError`` before anything trains.

    Layout: ``num_devices`` (jaxdp devices = DDP ranks) x ``accum_steps`` x
    ``micro_batch_size``; ``path``, ``strategy`` and ``step_options`` (more
    :func:`jaxdp.make_train_step` options) configure jaxdp's step; torch parameters
    without ``requires_grad`` are frozen in the port, a model with BatchNorm (NNX, or
    Linen ``batch_stats``) trains with DDP's per-rank statistics
    (``batch_stats="local"``). Tolerances:
    ``RTOL[dtype]``/``ATOL[dtype]`` unless given. ``locate``: run the divergence
    locator at the first step beyond tolerance (None, the default), also when every
    step passes (True, at the step that differs most), or never (False); its
    :class:`Divergence` is ``report.divergence``: the first quantity that differs in the
    order the step computes them (each micro-batch's output and loss, its gradients, the
    accumulated gradient, the learning rate, the optimizer's moments, the update) and its
    ``kind`` (the loss's normalization, the schedule, the optimizer's formula, weight decay
    or a mask, ...).

    ``loss_reduction="weighted"``: the loss returns ``(loss_sum, count)`` of a micro-batch
    (a token-weighted loss over padded rows: the sum over the real tokens and their
    number), on both sides. jaxdp's step divides the sum over every micro-batch and
    device by the global count; torch_ref does what a DDP script must (Hugging Face's
    ``num_items_in_batch``): counts the window's items first, all-reduces the count, and
    backpropagates ``loss_sum * world_size / count``. The divergence locator compares
    each micro-batch's ``loss_sum / global count`` and its count (the port's step may
    reduce otherwise through ``step_options``: the bug it then names). A loss of the
    other form (a ``(loss_sum, count)`` pair under ``"mean"``, a scalar under
    ``"weighted"``) raises ``ValueError`` when jaxdp's step first traces it, before
    either side trains.

    ``schedule=(torch_scheduler, optax_schedule)``: the learning rate of each step.
    ``torch_scheduler`` is a factory ``optimizer -> LRScheduler`` (``lambda opt:
    LambdaLR(opt, f)``, ``OneCycleLR(opt, ...)``; a top-level function or
    ``"MODULE:ATTR"`` with several devices), stepped after every ``optimizer.step()``;
    ``optax_schedule(count)`` the port's rate for the update after ``count`` updates
    (``base_lr * f(count)`` for ``LambdaLR``; for ``OneCycleLR`` with
    ``cycle_momentum=False``, :func:`onecycle_like_torch`), which replaces
    ``optimizer``'s rate in ``optax_like_torch`` (None when ``jax_optimizer`` holds the
    schedule). In float64 an optax schedule that returns float32 for optax's int32 count
    (``optax.linear_schedule`` does) is refused with the fix, before anything trains:
    its rounding alone is about 5e-8 relative, beyond float64's tolerance.
    """
    port = checked_port(
        torch_model,
        jax_model,
        data,
        loss=loss,
        optimizer=optimizer,
        jax_optimizer=jax_optimizer,
        mapping=mapping,
        step_options=step_options,
        num_devices=num_devices,
        accum_steps=accum_steps,
        micro_batch_size=micro_batch_size,
        steps=steps,
        dtype=dtype,
        path=path,
        strategy=strategy,
        shuffle=shuffle,
        seed=seed,
        last_window=last_window,
        torch_device=torch_device,
        locate=locate,
        loss_reduction=loss_reduction,
        schedule=schedule,
    )
    return compared(port, locate=locate, rtol=rtol, atol=atol)


def checked_port(
    torch_model: Any, jax_model: Any, data: Any, *, locate: bool | None, **options: Any
) -> Port:
    """:func:`compare_models`' first half: everything resolved and checked, and jaxdp's
    step traced on the first call (a loss that does not return what ``loss_reduction``
    takes fails here), before either side trains. ``jaxdp parity`` reports what this
    raises as a usage error."""
    if options["num_devices"] > 1:
        check_main_guard(f"compare_models(num_devices={options['num_devices']})")
    options = {"step_options": None, **options}
    port = prepare(torch_model, jax_model, data, **options)
    trace_jax_port(port)
    return port


def compared(
    port: Port, *, locate: bool | None, rtol: float | None, atol: float | None
) -> ParityReport:
    """:func:`compare_models`' second half: both sides trained and compared."""
    return report_of(port, run_torch_port(port), rtol=rtol, atol=atol, locate=locate)


def report_of(
    port: Port, result: Any, *, rtol: float | None, atol: float | None, locate: bool | None
) -> ParityReport:
    """The port trained and compared with torch_ref's ``result`` (a ``torch_ref.Result``
    of ``port.torch_job()``, or its first steps), the locator run as ``locate`` says."""
    torch_run = torch_trajectory(port, result)
    report = compare(port.config, run_jax_port(port), torch_run, rtol=rtol, atol=atol)
    if locate or (locate is None and not report.passed):
        step = report.first_failure or 1 + int(np.argmax([max(r.values()) for r in report.max_rel]))
        report.divergence = _locate(port, result.states, step, report.rtol, report.atol)
    return report


def assert_trains_like(
    torch_model: Any, jax_model: Any, data: Any, *, steps: int = 5, **options: Any
) -> ParityReport:
    """For a test suite: raises ``AssertionError`` with the report (per-step table and the
    divergence locator's finding) unless ``jax_model`` trains like ``torch_model`` within
    ``RTOL``/``ATOL`` of the dtype (float64: 1e-10 relative, 1e-12 absolute; float32:
    PyTorch's ``assertEqual`` defaults, 1.3e-6 and 1e-5) at every one of ``steps``
    optimizer steps. ``options`` are :func:`compare_models`'s; returns the report.
    """
    report = compare_models(torch_model, jax_model, data, steps=steps, **options)
    if not report.passed:
        raise AssertionError(
            f"the JAX model does not train like the torch model:\n{format_parity(report)}"
        )
    return report

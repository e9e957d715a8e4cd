"""Each optimizer step's metrics as host numbers (one transfer), with the rates a run logs."""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._step import TrainStep
from ..checkpoint._rules import named  # "aux/name" paths, as checkpoints name leaves
from ._flops import step_flops

_TOKENS = "\0tokens"  # the count passed as tokens=, beside metrics of any name


class Meter:
    """The numbers to log after each optimizer step: ``meter(state, metrics)``.

    Built once from the step and one batch (arrays or ``jax.ShapeDtypeStruct``, as
    :meth:`TrainStep.lower` takes them): ``flops`` is :func:`step_flops` (per optimizer
    step, every device), ``samples`` the global batch size. Called after each optimizer
    step (every call on the fused path; on the ``multisteps`` path the call that ends a
    window, ``metrics["emitted"]``), it returns a dict of Python numbers:

    - every metric of the step (``aux`` leaves as ``"aux/NAME"``) and ``"step"``, read
      with ONE device-to-host transfer (the scalars stacked on the device first), where
      ``float()`` per metric waits once each: an integer or boolean metric (``"step"``,
      ``"emitted"``, the skip counters) as an exact Python ``int`` at any size, a
      floating one as a ``float`` (float64 where x64 is on, else float32);
    - ``"learning_rate"``: the rate of the update just applied. From the metrics where
      the optimizer reports it (``optax.inject_hyperparams``); else from
      ``learning_rate=`` (a number, or the optax schedule given to the optimizer, read
      on the device at the update's count, ``step - 1``, in the same transfer; a
      schedule must return a scalar, checked when the meter is built); else
      left out, said once in a warning: a
      plain ``optax.adamw(schedule)`` keeps only a count in its state, and reading the
      schedule back out of optax's closures is not done;
    - from the second call on, over the wall time since the call before (which waits
      for the step, so it is the step's time): ``"samples_per_s"``, ``"tokens_per_s"``,
      ``"flops_per_s"`` and ``"mfu"`` (with ``peak_flops_per_device``: achieved over
      peak times the step's devices).

    ``"tokens_per_s"`` counts what the loss weights when the call gets it:
    ``meter(state, metrics, tokens=count)``, the step's count of real items (a weighted
    loss's count over the global batch, ``jnp.sum(labels != -100)``; on the multisteps
    path the window's), a number or a device scalar read in the same transfer; padding
    is then left out. Without ``tokens`` it is ``samples_per_s * tokens_per_sample``:
    every position of every row, padding included (given neither, it is left out).
    """

    def __init__(
        self,
        step: TrainStep,
        state: Any,
        batch: Any,
        *,
        peak_flops_per_device: float | None = None,
        tokens_per_sample: float | None = None,
        learning_rate: float | Callable[[Any], Any] | None = None,
    ):
        for name, value in (
            ("peak_flops_per_device", peak_flops_per_device),
            ("tokens_per_sample", tokens_per_sample),
        ):
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name}={value!r} must be a number > 0, or None")
        _check_rate(learning_rate)
        self.flops = step_flops(step, state, batch)
        sizes = step.sizes(batch)
        calls = step.accum_steps if step.path == "multisteps" else 1
        self.samples = sizes.global_batch_size * calls
        self.num_devices = step.num_devices
        self.peak = peak_flops_per_device
        self.tokens_per_sample = tokens_per_sample
        self.learning_rate = learning_rate
        self._last: float | None = None
        self._told = False

    def __call__(
        self, state: Any, metrics: dict[str, Any], *, tokens: Any = None
    ) -> dict[str, int | float]:
        if tokens is not None and jnp.shape(tokens) != ():
            raise ValueError(
                f"tokens must be a scalar (the step's count of the items the loss weights), "
                f"got shape {jnp.shape(tokens)}"
            )
        counted = {} if tokens is None else {_TOKENS: tokens}
        names, leaves = zip(*named({"step": state.step, **metrics, **counted}), strict=True)
        schedule = None
        if "learning_rate" not in metrics:
            if callable(self.learning_rate):
                schedule, names = self.learning_rate, (*names, "learning_rate")
            elif self.learning_rate is None:
                self._say_why_no_rate()
        # One transfer: the scalars (and the schedule's rate) stacked on the device first.
        kinds = tuple(_kind(x) for x in leaves) + (("float",) if schedule else ())
        host = jax.device_get(_stacked(leaves, state.step, schedule))
        values = dict(zip(names, _numbers(host, kinds), strict=True))
        tokens = values.pop(_TOKENS, None)
        if "learning_rate" not in values and self.learning_rate is not None:
            values["learning_rate"] = float(self.learning_rate)
        now = time.perf_counter()
        if self._last is not None:
            seconds = now - self._last
            values["samples_per_s"] = self.samples / seconds
            values["flops_per_s"] = self.flops / seconds
            if tokens is not None:
                values["tokens_per_s"] = tokens / seconds
            elif self.tokens_per_sample is not None:
                values["tokens_per_s"] = values["samples_per_s"] * self.tokens_per_sample
            if self.peak is not None:
                values["mfu"] = values["flops_per_s"] / (self.peak * self.num_devices)
        self._last = now
        return values

    def _say_why_no_rate(self) -> None:
        if not self._told:
            self._told = True
            warnings.warn(
                "Meter: the learning rate is not reported: the optimizer's state keeps only "
                "a step count (a plain optax.adamw(schedule)), and jaxdp does not read the "
                "schedule out of optax's closures; give Meter(learning_rate=schedule), or "
                "build the optimizer with optax.inject_hyperparams",
                stacklevel=3,
            )


def _check_rate(learning_rate: Any) -> None:
    """``learning_rate``: a number, a schedule returning a scalar (traced abstractly at
    count 0, as optax calls it), or None."""
    if learning_rate is None or isinstance(learning_rate, (int, float)):
        return
    if not callable(learning_rate):
        raise TypeError(
            f"learning_rate={learning_rate!r} must be a number, an optax schedule "
            "(a function of the step count), or None"
        )
    shape = jax.eval_shape(learning_rate, jax.ShapeDtypeStruct((), jnp.int32)).shape
    if shape != ():
        raise ValueError(
            f"learning_rate={learning_rate!r} returns shape {shape} at a step count; "
            "a schedule must return a scalar, the rate of one update"
        )


def _kind(x: Any) -> str:
    """How ``_stacked`` carries a leaf: ``"float"``, ``"signed"`` (also a bool) or
    ``"unsigned"``."""
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        return "unsigned"
    if jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_:
        return "signed"
    return "float"


def _widths() -> dict[str, Any]:
    """The float, signed and unsigned dtypes of one width: 64 bits with x64, else 32."""
    if jax.config.jax_enable_x64:
        return {"float": jnp.float64, "signed": jnp.int64, "unsigned": jnp.uint64}
    return {"float": jnp.float32, "signed": jnp.int32, "unsigned": jnp.uint32}


def _numbers(host: Any, kinds: tuple[str, ...]) -> list[int | float]:
    """The host vector as Python numbers: an integer leaf's bits read back as its
    integer, a float leaf as a float."""
    views = {kind: host.view(dtype) for kind, dtype in _widths().items()}
    return [views[kind][i].item() for i, kind in enumerate(kinds)]


@functools.partial(jax.jit, static_argnums=2)
def _stacked(
    leaves: tuple[Any, ...], step: jax.Array, schedule: Callable[[Any], Any] | None
) -> jax.Array:
    """The scalar leaves as one vector; with ``schedule`` its rate for the update just
    applied, at optax's count before it, ``step - 1``, last. A float leaf is cast to
    the vector's dtype; an integer or boolean one is carried exactly, its bits as an
    integer of the vector's width (a float32 holds integers exactly only to 2**24)."""
    widths = _widths()
    floating = widths["float"]

    def carried(x: Any) -> jax.Array:
        x = jnp.asarray(x).reshape(())
        kind = _kind(x)
        if kind == "float":
            return x.astype(floating)
        return jax.lax.bitcast_convert_type(x.astype(widths[kind]), floating)

    values = [carried(x) for x in leaves]
    if schedule is not None:
        count = jnp.maximum(step - 1, 0)
        values.append(jnp.asarray(schedule(count)).astype(floating).reshape(()))
    return jnp.stack(values)

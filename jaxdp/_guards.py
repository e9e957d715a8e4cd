"""Checks of what a user hands the step, each naming the argument, the rule and the values.

None of them reads a device value on a step's ordinary call: they look at Python
values, shapes, dtypes and tree structures, on the host before the call or while
the step traces a new input structure (so once, not per call). docs/semantics.md
("Errors and guards") lists every guard and what it costs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._frozen import trainable_mask
from ._train_state import TrainState


def check_params(
    params: Any, trainable: Any, name: str = "params", *, abstract: bool = False
) -> tuple[bool, ...]:
    """Every leaf an array, every trainable one floating-point (or complex); once, at init.
    ``abstract``: ``jax.ShapeDtypeStruct`` leaves count as arrays (``abstract_state``).

    Returns the trainable mask (:func:`jaxdp._frozen.trainable_mask`), computed
    after the leaves are known to be arrays (a predicate may read them).
    """
    leaves = jax.tree_util.tree_leaves_with_path(params)
    for path, leaf in leaves:
        if isinstance(leaf, jax.ShapeDtypeStruct) and not abstract:
            where = name + jax.tree_util.keystr(path)
            raise TypeError(
                f"{where} is a jax.ShapeDtypeStruct {leaf.shape} {leaf.dtype}: init places "
                "values on the devices; for a state of shapes alone (to lower or compile the "
                "step) call step.abstract_state(model) instead"
            )
        if _dtype(leaf) is None:
            where = name + jax.tree_util.keystr(path)
            raise TypeError(
                f"{where} is a {type(leaf).__name__} ({_short(leaf)}), not an array: every "
                "leaf of the parameters must be an array. Split static parts off the model "
                "first, or pass the model itself to step.init if it is an NNX, Linen or "
                "equinox module (jaxdp trains an equinox module's inexact arrays and keeps "
                "the rest static)"
            )
    mask = trainable_mask(params, trainable)
    for (path, leaf), trains in zip(leaves, mask, strict=True):
        dtype = _dtype(leaf)
        if trains and not jnp.issubdtype(dtype, jnp.inexact):
            where = name + jax.tree_util.keystr(path)
            raise TypeError(
                f"{where} has dtype {dtype}; every trainable parameter must be floating-point "
                "(gradients need real or complex values): freeze it with trainable= (e.g. a "
                "predicate (path, value) -> bool that is False for it) or keep it out of the "
                "parameters"
            )
    return mask


def _dtype(leaf: Any) -> Any:
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        dtype = leaf.dtype
    elif isinstance(leaf, (bool, int, float, complex)):
        dtype = np.asarray(leaf).dtype
    else:
        return None
    numeric = jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)
    return dtype if numeric else None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_micro_weights(weights: np.ndarray) -> None:
    """Host values only: a negative weight would step against the gradient."""
    if not np.all(np.isfinite(weights) & (weights >= 0)):
        raise ValueError(
            f"micro_weights={weights.tolist()} must be finite and at least 0 (1 for a "
            "micro-batch, 0 for the padding of an incomplete window)"
        )


def check_state_layout(state: TrainState, *, path: str, expected_opt_state: Any) -> None:
    """Refuses a state another step built (another path or optimizer), naming both.

    Run while the step traces (a new input structure): free on later calls.
    """
    built = "fused" if state.window is None else "multisteps"
    if built != path:
        raise ValueError(
            f"state was built by a step with path='{built}'; this step has "
            f"path='{path}': build the state with this step's init, or use a "
            f"step with path='{built}'"
        )
    if jax.tree.structure(expected_opt_state) != jax.tree.structure(state.opt_state):
        raise ValueError(
            f"state.opt_state was built by another optimizer: it holds "
            f"{describe_layout(state.opt_state)}; this step's optimizer keeps "
            f"{describe_layout(expected_opt_state)}. Build the state with this step's init, "
            "or the step with the optimizer the state was made for"
        )


def check_params_layout(
    trainable: Any, expected: list[tuple[int, ...]], logical: list[tuple[int, ...]], *, step: str
) -> None:
    """Refuses parameters another layout laid out: a leaf ZeRO stage 3 holds padded to a
    multiple of one shard count, given to a step that pads it to another (or not at all),
    naming the leaf and both shapes (before: a gather of the wrong size, or
    ``IndivisibleError``). ``expected``: the shapes this step holds them in; ``logical``:
    the model's."""
    named = jax.tree_util.tree_flatten_with_path(trainable)[0]
    for (path, x), want, own in zip(named, expected, logical, strict=True):
        if tuple(jnp.shape(x)) != tuple(want):
            padded = f"the model's {own} padded" if tuple(want) != tuple(own) else "as the model's"
            raise ValueError(
                f"state.params{jax.tree_util.keystr(path)} has shape {jnp.shape(x)}; this "
                f"step ({step}) holds it as {tuple(want)} ({padded}). The state was built by "
                "a step of another layout: build it with this step's init, or restore a "
                "checkpoint with this step's init as the template"
            )


def check_window_layout(
    grads: Any, expected: Any, trainable: Any, *, num_devices: int, zero_stage: int, shards: Any
) -> None:
    """Refuses a multisteps window whose gradient sums another layout laid out (another ZeRO
    stage or ``shards``), naming both: per device, split, or per replica group, they differ
    in shape (before: shard_map's "not evenly divisible" or a failed reshape)."""
    named = jax.tree_util.tree_flatten_with_path(grads)[0]
    wanted, params = jax.tree.leaves(expected), jax.tree.leaves(trainable)
    for (path, x), want, param in zip(named, wanted, params, strict=True):
        if jnp.shape(x) != want.shape:
            step = f"zero_stage={zero_stage}" + (f", shards={shards}" if shards else "")
            raise ValueError(
                f"state.window.grads{jax.tree_util.keystr(path)} has shape {jnp.shape(x)}, "
                f"the sums {_sums(jnp.shape(x), jnp.shape(param), num_devices)}; this step "
                f"({step}) keeps them {_sums(want.shape, jnp.shape(param), num_devices)}, "
                f"shape {want.shape}. The state was built by a multisteps step of another layout: "
                "build it with this step's init, or move it through jaxdp.checkpoint (a "
                "restore lays a window's sums out for the step it restores to)"
            )


def _sums(shape: tuple[int, ...], param: tuple[int, ...], num_devices: int) -> str:
    """How a window's sum of a parameter of shape ``param`` lies, from its ``shape``."""
    if shape == param:
        return "split over the devices (zero_stage 2 or 3)"
    if shape == (num_devices, *param):
        return "per device (zero_stage 0 or 1)"
    if shape[1:] == param and num_devices % shape[0] == 0:
        groups = shape[0]
        return f"per replica group, {groups} groups (HSDP, shards={num_devices // groups})"
    return "in another layout"


def describe_layout(tree: Any) -> str:
    """An optimizer state's node types, e.g. ``(ScaleByAdamState, EmptyState, EmptyState)``."""
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree).__name__
    if isinstance(tree, (tuple, list)):
        return "(" + ", ".join(describe_layout(x) for x in tree) + ")"
    return type(tree).__name__


def check_state_devices(sharding: Any, devices: set[Any]) -> None:
    """Refuses a state whose step counter (``sharding``) is on other devices than the
    step's mesh (``devices``): host only, the sharding's device set."""
    if sharding is None or sharding.device_set == devices:
        return
    theirs = sorted(d.id for d in sharding.device_set)
    raise ValueError(
        f"state is on devices {theirs}; this step's mesh has devices "
        f"{sorted(d.id for d in devices)}: the state was built by a step on another mesh. "
        "Build it with this step (step.init), or restore a checkpoint with this step's "
        "init as the template"
    )


def is_loader_batch(batch: Any) -> bool:
    """A :class:`jaxdp.data.Batch` (the core does not import the data package)."""
    return all(hasattr(batch, f) for f in ("data", "micro_weights", "sizes", "path", "emits"))


def check_loader_batch(batch: Any, *, path: str, num_devices: int, accum_steps: int) -> None:
    """Refuses a loader's batch built for another path, device count or accum_steps."""
    theirs = (batch.path, batch.sizes.num_devices, batch.sizes.accum_steps)
    if (path, num_devices, accum_steps) != theirs:
        raise ValueError(
            f"the batch comes from a Loader with path={batch.path!r}, "
            f"{batch.sizes.describe()}; this step has path={path!r}, "
            f"num_devices={num_devices}, accum_steps={accum_steps}: build "
            "the Loader with the step's path, mesh and accum_steps (Loader.for_step(step, "
            "source, micro_batch_size=...) takes them from the step)"
        )

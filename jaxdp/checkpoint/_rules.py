"""Which checkpoints fit a run: the layout of the saved state, the batch identity and
the position (where to continue is :func:`jaxdp.resume_position`)."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from .._layout import BatchSizes
from .._position import SamplerPosition
from .._train_state import TrainState
from ._window import relaid


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: none there, unreadable, or incompatible."""


def check_is_directory(directory: str | pathlib.Path, *, name: str) -> None:
    """Raises :class:`CheckpointError` if ``directory`` (argument ``name``), or a folder
    above it, is a file. A missing directory passes: it is created."""
    given = pathlib.Path(directory).absolute()
    for path in (given, *given.parents):
        if path.exists():
            if not path.is_dir():
                what = "is" if path == given else f"is inside {path}, which is"
                raise CheckpointError(
                    f"{name}={str(directory)!r} {what} a file, not a directory: checkpoints "
                    "are directories inside it (a missing one is created)"
                )
            return


def check_compatible(
    meta: dict[str, Any],
    here: dict[str, Any],
    sizes: BatchSizes | None,
    *,
    force: bool,
    path: pathlib.Path,
    validate: Callable[[dict[str, Any]], None] | None,
) -> BatchSizes | None:
    """Raises :class:`CheckpointError` unless checkpoint ``meta`` fits this run; returns
    the batch identity it was saved with (None: saved without one).

    ``here`` describes this run's state leaves (:func:`describe` by :func:`named`);
    ``sizes`` this run's batch identity (None: only for a checkpoint saved without one).
    """
    saved_leaves = meta["leaves"]
    mismatches = _mismatches(saved_leaves, here, lambda name: name.startswith("params/"))
    if mismatches:
        raise CheckpointError(
            f"checkpoint {path} was saved for a different model; parameters (checkpoint vs "
            f"this run): {'; '.join(mismatches)}"
        )
    if validate is not None:
        validate(meta["extra"])
    # The window's sums are compared by dtype: their shapes follow the mesh, and at a
    # step boundary they are zero and rebuilt for this run's (below: mid-window).
    mismatches = _mismatches(
        saved_leaves, here, lambda name: not name.startswith("params/"), loose=is_accumulator
    )
    if mismatches:
        raise CheckpointError(
            f"checkpoint {path} holds a differently laid out training state (another "
            f"optimizer or accumulation path?); checkpoint vs this run: {'; '.join(mismatches)}"
        )
    if meta["batch"] is None:
        # Saved without a batch identity (a pipeline of the user's own): nothing to compare,
        # and never mid-window (save refuses that without one).
        return None
    saved = BatchSizes(**meta["batch"])
    if sizes is None:
        raise CheckpointError(
            f"checkpoint {path} was saved with {saved.describe()}; give sizes= (this run's "
            "batch identity) or data= (a jaxdp.data.Loader) to restore it: a checkpoint "
            "saved with a position is checked against the run that continues it"
        )
    micro = meta["position"]["micro_batch"]
    if saved.global_batch_size != sizes.global_batch_size and not force:
        raise CheckpointError(
            f"checkpoint {path} was trained with {saved.describe()}; this run has "
            f"{sizes.describe()}. Another global batch changes the data order (optimizer "
            "step s takes rows [s * global_batch_size, (s + 1) * global_batch_size) of each "
            "epoch's order) and what a step means (samples per update, learning-rate "
            "schedule). Keep global_batch_size and change accum_steps or micro_batch_size, "
            "or force the resume (--force-resume)"
        )
    if saved != sizes and micro != 0:
        raise CheckpointError(
            f"checkpoint {path} was taken in the middle of an accumulation cycle (micro-batch "
            f"{micro} of {saved.accum_steps}); its per-device accumulators belong to "
            f"{saved.describe()} and cannot be re-split for {sizes.describe()}. Resume with "
            "the saved batch identity (its next checkpoint at a step boundary can then move), "
            f"or move {path} aside to resume from the checkpoint before it"
        )
    # Mid-window a gradient sum in another layout (another ZeRO stage, HSDP or not) keeps
    # its total and is re-laid out as it is read (:mod:`._window`); other shapes must fit,
    # and all of a format 2 window (jaxdp 0.2's, read by :mod:`._format2`).
    relays = meta["format"] != 2

    def must_fit(name: str) -> bool:
        if not is_accumulator(name):
            return False
        return not (relays and name in here and relaid(name, saved_leaves, here[name]["shape"]))

    mismatches = _mismatches(saved_leaves, here, must_fit, shapes=micro != 0)
    if mismatches:
        raise CheckpointError(
            f"checkpoint {path} was taken in the middle of an accumulation cycle (micro-batch "
            f"{micro}) with a window this run's cannot take (another aux or batch statistics?): "
            f"{'; '.join(mismatches)}. Resume with the saved options, or move {path} aside"
        )
    return saved


def _mismatches(
    saved: dict[str, Any],
    here: dict[str, Any],
    selected: Callable[[str], bool],
    loose: Callable[[str], bool] = lambda name: False,
    shapes: bool = True,
) -> list[str]:
    """Human-readable differences between two ``name -> description`` maps, by shape and
    dtype (``loose`` names and, without ``shapes``, every name: by dtype only). Where a
    leaf lies (replicated or split) may differ: restoring re-lays it out."""
    out = []
    for name in sorted(n for n in {*saved, *here} if selected(n)):
        a, b = saved.get(name), here.get(name)
        if a is None:
            out.append(f"{name} missing in the checkpoint")
        elif b is None:
            out.append(f"{name} missing in this run")
        elif loose(name) or not shapes:
            if a["dtype"] != b["dtype"]:
                out.append(f"{name} {a['dtype']} vs {b['dtype']}")
        elif (a["shape"], a["dtype"]) != (b["shape"], b["dtype"]):
            out.append(f"{name} {_layout_str(a)} vs {_layout_str(b)}")
    return out


def _layout_str(d: dict[str, Any]) -> str:
    return f"{tuple(d['shape'])} {d['dtype']}"


def check_position(state: TrainState, position: SamplerPosition) -> None:
    """Raises unless ``position.micro_batch`` is the state's place in its accumulation cycle."""
    if state.window is not None:
        done = int(state.window.position)
        if position.micro_batch != done:
            raise ValueError(
                f"position.micro_batch={position.micro_batch} must equal the state's "
                f"window.position={done} (micro-batches into the open cycle)"
            )
    elif position.micro_batch != 0:
        raise ValueError(
            f"position.micro_batch={position.micro_batch} must be 0 on the fused path "
            "(every call is a whole optimizer step)"
        )


def is_per_device(x: Any) -> bool:
    """Whether ``x`` is split over the mesh (the window's per-device sums, ZeRO's leaves)."""
    sharding = getattr(x, "sharding", None)
    return isinstance(sharding, NamedSharding) and any(a is not None for a in sharding.spec)


def leaf_name(path: Any) -> str:
    """``"params/hidden/kernel"``; NNX's ``.value`` is left out of names."""
    keys = [k for k in path if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")]
    return jax.tree_util.keystr(tuple(keys), simple=True, separator="/")


def named(tree: Any) -> list[tuple[str, Any]]:
    """``("params/hidden/kernel", leaf)`` pairs (:func:`leaf_name`)."""
    return [(leaf_name(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def is_accumulator(name: str) -> bool:
    """The open window's sums (multisteps): zero at an optimizer-step boundary."""
    return name.startswith("window/") and not name.startswith(("window/position", "window/last/"))


def describe(x: Any, shape: Any = None) -> dict[str, Any]:
    """Shape, dtype and placement of a leaf, as stored in a checkpoint's meta. ``shape``:
    the model's shape of a leaf the state holds padded (ZeRO stage 3), which ``shape``
    records, and ``stored`` the padded one it is written in."""
    out = {
        "shape": list(x.shape if shape is None else shape),
        "dtype": str(jnp.dtype(x.dtype)),
        "per_device": is_per_device(x),
    }
    if shape is not None and tuple(shape) != tuple(x.shape):
        out["stored"] = list(x.shape)
    return out

"""A checkpoint's data position: from and to a loader (``save(data=)``, ``restore(data=)``),
or a team's own pipeline's small JSON record (``save(data={...})``, ``Restored.data``).

The checkpoint keeps the loader's whole :meth:`jaxdp.data.Loader.state` (the
position, the batch identity, the data set's length and order) in its meta, so a
restore can refuse a position that indexes another data set's order. A dict is
kept as given (as JSON reads it back) under its own key and handed back, never
interpreted: the team's pipeline sets itself from it. This package does not
import :mod:`jaxdp.data`: a loader is anything of this shape.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

from .._layout import BatchSizes
from .._position import SamplerPosition
from .._train_state import TrainState
from ._rules import CheckpointError

OWN = "own_data"  # the meta's key of a dict given as data=


class DataPosition(Protocol):
    """What ``save``/``restore`` take as ``data=``: a :class:`jaxdp.data.Loader`."""

    sizes: BatchSizes

    def state(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any], *, force: bool = False) -> SamplerPosition: ...


class Saved(NamedTuple):
    """What ``save`` writes of the data: jaxdp's position (or None: saved without one)
    and batch identity, samples, seed, and the loader's state or the team's own dict."""

    position: SamplerPosition | None
    sizes: BatchSizes | None
    samples: int | None
    seed: int
    loader: dict[str, Any] | None
    own: dict[str, Any] | None


def from_data(
    state: TrainState,
    data: DataPosition | Mapping[str, Any] | None,
    position: SamplerPosition | None,
    sizes: BatchSizes | None,
    samples: int | None,
    seed: int | None,
) -> Saved:
    """``save``'s data: from a loader, or as given; nothing at all for a team's own pipeline
    (``data`` None or a dict), at an optimizer-step boundary."""
    if data is not None and not isinstance(data, Mapping):
        if position is not None or sizes is not None:
            raise ValueError(
                "give data= (a loader: its position and batch identity) or position= and "
                "sizes=, not both"
            )
        loader = data.state()
        position = SamplerPosition(loader["epoch"], loader["step_in_epoch"], loader["micro_batch"])
        samples = loader["samples"] if samples is None else samples
        seed = loader.get("seed", 0) if seed is None else seed  # a stream orders itself
        return Saved(position, BatchSizes(**loader["batch"]), samples, seed, loader, None)
    own = None if data is None else _own(data)
    given = {"position": position, "sizes": sizes, "samples": samples}
    if any(v is None for v in given.values()) and any(v is not None for v in given.values()):
        missing = ", ".join(f"{k}=" for k, v in given.items() if v is None)
        raise ValueError(
            f"give {missing} too, or none of position=, sizes= and samples= (a checkpoint of "
            "the state alone, with your own pipeline's position in data={...})"
        )
    window = state.window
    if position is None and window is not None and int(window.position) != 0:
        raise ValueError(
            f"the state is {int(window.position)} micro-batches into its accumulation window: "
            "its per-device sums belong to one batch identity, so a checkpoint there needs "
            "position=, sizes= and samples= (or data= a jaxdp.data.Loader); or save after "
            "the call that ends the window"
        )
    return Saved(position, sizes, samples, seed or 0, None, own)


def _own(data: Mapping[str, Any]) -> dict[str, Any]:
    """A team's data record as JSON will read it back; refused before anything is written
    if JSON cannot hold it."""
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ValueError(
            f"data= keys must be strings (JSON object keys); {bad[0]!r} is a "
            f"{type(bad[0]).__name__}"
        )
    try:
        return json.loads(json.dumps(dict(data), allow_nan=False))
    except (TypeError, ValueError) as e:
        given = repr(dict(data))
        given = given if len(given) <= 200 else given[:200] + "..."
        raise ValueError(
            f"data={given} must be JSON (dicts of str keys, lists, str, int, finite float, "
            f"bool, None): {e}"
        ) from None


def sizes_of(data: DataPosition | None, sizes: BatchSizes | None) -> BatchSizes | None:
    """``restore``'s batch identity: ``sizes``, else the loader's, else None (then only a
    checkpoint saved without one restores)."""
    if sizes is not None or data is None:
        return sizes
    if isinstance(data, Mapping):
        raise ValueError(
            "restore(data=) takes a jaxdp.data.Loader to set; the dict given to "
            "save(data=...) comes back as Restored.data"
        )
    return data.sizes


def _saved(meta: dict[str, Any], path: pathlib.Path) -> dict[str, Any]:
    if meta.get("data"):
        return meta["data"]
    if meta["position"] is None:
        raise CheckpointError(
            f"checkpoint {path} was saved without a data position (save(state) or "
            "save(state, data={...})): restore it without data= and set your pipeline from "
            "Restored.data"
        )
    return {**meta["position"], "samples": meta["samples"], "batch": meta["batch"]}


def check_data(data: DataPosition, meta: dict[str, Any], *, path: pathlib.Path) -> None:
    """Refuses a checkpoint saved for other data (its order, or its fingerprint), if ``data``
    can tell (a :class:`jaxdp.data.Loader` can: ``check_data``), before anything else."""
    saved = _saved(meta, path)
    check = getattr(data, "check_data", None)
    if check is None:
        return
    try:
        check(saved)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None


def restore_data(
    data: DataPosition, meta: dict[str, Any], *, force: bool, path: pathlib.Path
) -> None:
    """Sets ``data`` to the checkpoint's position (a bare position: checked as far as it goes)."""
    try:
        data.restore(_saved(meta, path), force=force)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None

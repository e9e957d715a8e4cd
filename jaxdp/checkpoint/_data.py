"""A checkpoint's data position from and to a loader (``save(data=)``, ``restore(data=)``).

The checkpoint keeps the loader's whole :meth:`jaxdp.data.Loader.state` (the
position, the batch identity, the data set's length and order) in its meta, so a
restore can refuse a position that indexes another data set's order. This
package does not import :mod:`jaxdp.data`: a loader is anything of this shape.
"""

from __future__ import annotations

import pathlib
from typing import Any, Protocol

from .._layout import BatchSizes
from .._position import SamplerPosition
from ._rules import CheckpointError


class DataPosition(Protocol):
    """What ``save``/``restore`` take as ``data=``: a :class:`jaxdp.data.Loader`."""

    sizes: BatchSizes

    def state(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any], *, force: bool = False) -> SamplerPosition: ...


def from_data(
    data: DataPosition | None,
    position: SamplerPosition | None,
    sizes: BatchSizes | None,
    samples: int | None,
    seed: int | None,
) -> tuple[SamplerPosition, BatchSizes, int, int, dict[str, Any] | None]:
    """``save``'s position, batch identity, samples and seed, from ``data`` or as given."""
    if data is None:
        if position is None or sizes is None or samples is None:
            raise ValueError("give position=, sizes= and samples=, or data= (a loader)")
        return position, sizes, samples, seed or 0, None
    if position is not None or sizes is not None:
        raise ValueError(
            "give data= (a loader: its position and batch identity) or position= and sizes=, "
            "not both"
        )
    loader = data.state()
    position = SamplerPosition(loader["epoch"], loader["step_in_epoch"], loader["micro_batch"])
    samples = loader["samples"] if samples is None else samples
    seed = loader["seed"] if seed is None else seed
    return position, BatchSizes(**loader["batch"]), samples, seed, loader


def sizes_of(data: DataPosition | None, sizes: BatchSizes | None) -> BatchSizes:
    """``restore``'s batch identity: ``sizes``, else the loader's."""
    if sizes is not None:
        return sizes
    if data is None:
        raise ValueError("give sizes= (this run's batch identity) or data= (a loader)")
    return data.sizes


def _saved(meta: dict[str, Any]) -> dict[str, Any]:
    return meta.get("data") or {
        **meta["position"],
        "samples": meta["samples"],
        "batch": meta["batch"],
    }


def check_data(data: DataPosition, meta: dict[str, Any], *, path: pathlib.Path) -> None:
    """Refuses a checkpoint saved for other data (its order, or its fingerprint), if ``data``
    can tell (a :class:`jaxdp.data.Loader` can: ``check_data``), before anything else."""
    check = getattr(data, "check_data", None)
    if check is None:
        return
    try:
        check(_saved(meta))
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None


def restore_data(
    data: DataPosition, meta: dict[str, Any], *, force: bool, path: pathlib.Path
) -> None:
    """Sets ``data`` to the checkpoint's position (a bare position: checked as far as it goes)."""
    try:
        data.restore(_saved(meta), force=force)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None

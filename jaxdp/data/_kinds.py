"""How the loader reads a source that is not array fields: which libraries' objects it
knows, and how each gives a call's rows in one batched read.

- A Hugging Face ``datasets.Dataset`` is read in numpy format whatever its own
  format (python lists, torch, arrow, pandas...): one ``ds[rows]`` per call gives
  a dict of arrays, rows on the leading axis, exactly what ``.with_format("numpy")``
  gives. A dataset with its own transform (``with_transform``) keeps it, read as
  records by ``__getitems__``.
- A grain ``MapDataset`` is read by its batched interface, ``_getitems`` (grain's
  protocol for batched reads, ``SupportsBatchedReadRandomAccessDataSource``: an
  ArrayRecord source behind it reads a call's records together).
- Any other object with ``__getitems__(rows) -> records`` (torch's convention for
  batched map-style datasets) is read a call's rows in one call.

Neither ``datasets`` nor ``torch`` is imported here: their objects are known by the
module of their type, so jaxdp imports a library only when given one of its objects.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

Records = Callable[[list[int]], Sequence[Any]]
"""``read(rows) -> records``: the records at ``rows``, in that order."""


def is_kind(source: Any, library: str, name: str) -> bool:
    """Whether ``source`` is (a subclass of) ``library``'s class ``name``, by its type's
    classes alone (nothing imported)."""
    return any(
        cls.__name__ == name and (cls.__module__ or "").partition(".")[0] == library
        for cls in type(source).__mro__
    )


def hugging_face_columns(source: Any) -> Any | None:
    """A ``datasets.Dataset``'s numpy-format view (its selected columns, or all of them
    with ``output_all_columns``); None for any other object, and for a dataset with its
    own transform (its records are what the transform returns)."""
    if not is_kind(source, "datasets", "Dataset"):
        return None
    form = source.format
    if form["type"] == "custom":
        return None
    columns = form["columns"]
    if form["output_all_columns"] or columns is None:
        columns = source.column_names
    return source.with_format("numpy", columns=list(columns))


def batched_records(source: Any) -> Records | None:
    """The batched read of ``source``'s records, or None for a record-at-a-time source.

    Raises ``ValueError`` for a grain ``MapDataset`` without a finite length (an
    endless ``repeat()``: the loader's epochs need the data set's rows).
    """
    if is_kind(source, "grain", "MapDataset"):
        import grain

        if isinstance(source, grain.MapDataset):  # the class grain exports, not a namesake
            if len(source) >= sys.maxsize:
                raise ValueError(
                    f"source is a grain MapDataset of length {len(source)} (endless: "
                    "repeat() without num_epochs); the loader needs the data set's rows "
                    "once: drop the repeat() and set the Loader's epochs"
                )
            return source._getitems  # grain's batched-read protocol (see the module doc)
    getitems = getattr(source, "__getitems__", None)
    return getitems if callable(getitems) else None

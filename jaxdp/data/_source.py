"""What the loader reads: a random-access source, checked once, read a call's rows at a time.

A source is a numpy array or ``np.memmap`` (rows on the leading axis), a dict or
tuple of them (one field each, the same number of rows), or anything
with ``__len__`` and ``__getitem__(index) -> record`` (a Hugging Face
``datasets.Dataset``, a grain ``MapDataset`` or data source, a torch map-style
``Dataset``). Each call's rows are read together where the source allows it:

- array fields with one fancy index per field (a memmap reads only those rows,
  from its file: ``_fingerprint.read_rows``);
- a Hugging Face ``Dataset``, in any format, with one ``ds[rows]`` of its numpy
  format: a dict of arrays (``_kinds.hugging_face_columns``);
- a grain ``MapDataset``, or a source with ``__getitems__``, with one batched read
  of the call's records (``_kinds.batched_records``);
- anything else one record at a time.

Records (with a ``transform``, every source's) are stacked field by field.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._fingerprint import (
    DataChangedError,
    batched_fingerprint,
    check_files,
    fingerprint,
    memmapped_files,
    read_rows,
    records_fingerprint,
)
from ._kinds import batched_records, hugging_face_columns

Transform = Callable[[Any], Any]
"""``transform(record) -> record``, applied to every record read, in a loader worker."""


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _fields(source: Any) -> Any | None:
    """The tree of array fields of ``source``, or None for a record-by-record source."""
    if _is_array(source):
        return source
    # A list is records (one each), a dict or tuple fields (the rows of each).
    if isinstance(source, (Mapping, tuple)) and source:
        leaves = jax.tree.leaves(source, is_leaf=_is_array)
        if leaves and all(_is_array(x) for x in leaves):
            return source
    return None


class Source:
    """A checked random-access source: ``len(source)`` rows, ``read(rows)`` a stacked batch.

    Raises ``ValueError`` at construction for an empty source, array fields of
    different lengths (naming each), a field without rows (a 0-d array), an
    endless grain ``MapDataset``, and ``TypeError`` for an object without
    ``__len__`` and ``__getitem__`` (an iterable one is a stream: ``_stream.Stream``).
    A read raises :class:`~jaxdp.data.DataChangedError` once a file behind a
    memmapped field has changed since construction, and ``ValueError`` for a
    missing record (``None``: a grain ``filter``) or a batched read that returns
    another number of records than asked.
    """

    def __init__(self, source: Any, transform: Transform | None = None):
        if transform is not None and not callable(transform):
            raise TypeError(f"transform={transform!r} must be callable (record -> record) or None")
        self.transform = transform
        self.fields = _fields(source)
        self.columns = self.batched = None
        if self.fields is not None:
            self.length = _common_length(self.fields)
        elif hasattr(source, "__len__") and hasattr(source, "__getitem__"):
            self.columns = hugging_face_columns(source)
            source = source if self.columns is None else self.columns
            self.batched = batched_records(source)
            self.length = len(source)
        else:
            raise TypeError(
                f"source is a {type(source).__name__}: it must be an array, a dict/tuple of "
                "arrays, have __len__ and __getitem__ (random access by record index), or "
                "be iterable (a stream: a grain IterDataset, a Hugging Face IterableDataset)"
            )
        if self.length == 0:
            raise ValueError("source is empty (0 rows): there is nothing to train on")
        if self.fields is not None and transform is None:
            for path, leaf in jax.tree_util.tree_leaves_with_path(self.fields, is_leaf=_is_array):
                _check_dtype("source" + jax.tree_util.keystr(path), np.dtype(leaf.dtype))
        if self.columns is not None and transform is None:  # a transform may encode text
            _check_columns(self.columns)
        self.source = source
        self.files = memmapped_files(self.fields)
        self._reading: dict[int, tuple[int, float]] = {}  # thread -> (record, since when)
        self._fingerprint: dict[str, Any] | None = None
        if self.fields is not None:
            # Taken now: a file changed later must not be hashed as this run's data.
            self._fingerprint = fingerprint(self.fields, self.length)

    @property
    def fingerprint(self) -> dict[str, Any]:
        """Rows, fields and a content digest of the data as read (no transform).

        Array fields are hashed at construction; a Hugging Face ``Dataset`` (its
        numpy batches) or a record-by-record source at the first call (a
        checkpoint or a restore), since its reads may fail or count.
        """
        if self._fingerprint is None and self.columns is not None:
            self._fingerprint = batched_fingerprint(self._columns, self.length, source=self.source)
        elif self._fingerprint is None:
            self._fingerprint = records_fingerprint(self.source, self.length, batched=self.batched)
        return self._fingerprint

    def __len__(self) -> int:
        return self.length

    def read(self, rows: np.ndarray) -> Any:
        """The records ``rows`` (in that order, repeats included) as one batch per field."""
        check_files(self.files)
        me = threading.get_ident()
        try:
            if self.fields is not None and self.transform is None:
                self._reading[me] = (int(rows[0]), time.monotonic())
                try:
                    return jax.tree.map(
                        lambda x: read_rows(x, rows), self.fields, is_leaf=_is_array
                    )
                except DataChangedError:
                    check_files(self.files)  # the usual words (what changed) where it can tell
                    raise
            if self.columns is not None and self.transform is None:
                self._reading[me] = (int(rows[0]), time.monotonic())
                return checked(self._columns(rows), rows, "column")
            if self.batched is not None:
                self._reading[me] = (int(rows[0]), time.monotonic())
                records = self._batch(rows)
            else:
                records = [self._record(int(i), me) for i in rows]
            return checked(stack(records, rows), rows, "field")
        finally:
            self._reading.pop(me, None)

    def _columns(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """A Hugging Face dataset's rows in one read: a dict of arrays, in numpy format."""
        assert self.columns is not None
        return {name: np.asarray(a) for name, a in self.columns[rows.tolist()].items()}

    def _batch(self, rows: np.ndarray) -> list[Any]:
        """The records of ``rows`` in one batched read, each through the transform."""
        assert self.batched is not None
        records = list(self.batched(rows.tolist()))
        if len(records) != len(rows):
            raise ValueError(
                f"the source's batched read of {len(rows)} records (from record "
                f"{int(rows[0])}) returned {len(records)}: it must return one record per index"
            )
        return [self._transformed(r, int(i)) for i, r in zip(rows, records, strict=True)]

    def stuck(self) -> str:
        """The read that has run longest, in words (for a read timeout's error)."""
        reading = list(self._reading.values())
        if not reading:
            return "no read is running (the placement on the devices is slow or stuck)"
        index, since = min(reading, key=lambda r: r[1])
        age = time.monotonic() - since
        return f"the read of source record {index} has not returned in {age:.1f} s"

    def _record(self, index: int, me: int) -> Any:
        self._reading[me] = (index, time.monotonic())
        if self.fields is not None:
            record = jax.tree.map(lambda x: x[index], self.fields, is_leaf=_is_array)
        else:
            record = self.source[index]
        return self._transformed(record, index)

    def _transformed(self, record: Any, index: int) -> Any:
        if record is None:
            raise ValueError(
                f"source record {index} is None (a grain MapDataset's filter() leaves "
                "None for a dropped record): every index up to len(source) must hold a "
                "record; filter the data before the loader, or in its transform"
            )
        return transformed(self.transform, record, index)


def transformed(transform: Transform | None, record: Any, index: int) -> Any:
    """``transform(record)``, its error naming the record (``index``); the record without one."""
    if transform is None:
        return record
    try:
        return transform(record)
    except Exception as e:
        raise ValueError(
            f"transform raised on record {index} of the source: {type(e).__name__}: {e}"
        ) from e


# A Hugging Face feature whose values are text or bytes (alone or in a list).
_TEXT = ("string", "large_string", "binary", "large_binary")


def _is_numeric(dtype: np.dtype) -> bool:
    """Whether JAX takes arrays of ``dtype`` (bool, integers, floats, complex, bfloat16...)."""
    return bool(jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_))


def _check_dtype(name: str, dtype: np.dtype) -> None:
    if not _is_numeric(dtype):
        raise ValueError(
            f"{name} has dtype {dtype}: a batch goes to JAX, which takes numbers and booleans "
            "only; leave it out of the source (or encode it, e.g. in a transform)"
        )


def _check_columns(dataset: Any) -> None:
    """Refuses a Hugging Face column of text before any read: JAX would refuse its
    batch at the first step ("Dtype <U6 is not a valid JAX array type"), naming nothing."""
    for name, feature in dataset.features.items():
        inner = feature
        while hasattr(inner, "feature"):  # List(...), Sequence(...): their values
            inner = inner.feature
        if getattr(inner, "dtype", None) in _TEXT:
            raise ValueError(
                f"source column {name!r} holds text ({feature}): a batch goes to JAX, which "
                f"takes numbers and booleans only; drop it with dataset.remove_columns("
                f"[{name!r}]) or keep the ones to train on with dataset.select_columns([...]) "
                "(or tokenize it first, e.g. with dataset.map)"
            )


def checked(batch: Any, rows: np.ndarray, kind: str) -> Any:
    """``batch``, after checking that JAX takes each of its arrays; names the field
    (``kind``: column or field) and the records."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        dtype = np.asarray(leaf).dtype
        if _is_numeric(dtype):
            continue
        name = jax.tree_util.keystr(path)
        shown = rows.tolist()[:8]
        where = f"records {shown}" if len(rows) <= 8 else f"records {shown[:-1] + ['...']}"
        why = (
            "its rows have different lengths (ragged) or hold Python objects, which make no "
            "array: pad or cut them to one length (e.g. with dataset.map or a transform), "
            f"or drop the {kind}"
            if dtype.kind == "O"
            else "JAX takes numbers and booleans only: drop it or encode it"
        )
        raise ValueError(
            f"source {kind} {name} of the batch of {where} has numpy dtype {dtype}: {why}"
        )
    return batch


def _common_length(fields: Any) -> int:
    named = jax.tree_util.tree_leaves_with_path(fields, is_leaf=_is_array)
    lengths = {}
    for path, leaf in named:
        name = "source" + jax.tree_util.keystr(path)
        if not leaf.shape:
            raise ValueError(f"{name} has shape (); every field needs a leading axis of rows")
        lengths[name] = leaf.shape[0]
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{name} has {n}" for name, n in lengths.items())
        raise ValueError(
            f"the source's fields must have the same number of rows (one record each): {listed}"
        )
    return next(iter(lengths.values()))


def stack(records: list[Any], rows: np.ndarray) -> Any:
    """One array per field with the records on the leading axis; names a record that differs."""
    # One flatten per record (not a tree.map per check): a third of a record's cost.
    flat = [jax.tree.flatten(record) for record in records]
    structure = flat[0][1]
    shapes = [np.shape(leaf) for leaf in flat[0][0]]
    for index, record, (leaves, treedef) in zip(rows, records, flat, strict=True):
        if treedef != structure or [np.shape(leaf) for leaf in leaves] != shapes:
            first = jax.tree.map(np.shape, records[0])
            theirs = jax.tree.map(np.shape, record)
            raise ValueError(
                f"source record {int(index)} has fields and shapes {theirs}, record "
                f"{int(rows[0])} has {first}: every record needs the same fields and shapes "
                "to stack into a batch"
            )
    fields = [np.stack([np.asarray(leaves[k]) for leaves, _ in flat]) for k in range(len(shapes))]
    return jax.tree.unflatten(structure, fields)

"""What a loader's data are: a fingerprint saved with its position and compared on restore,
and a watch on the files behind memmapped fields while the loader reads them.

A position indexes one data set's order, so a restore must find the same data,
wherever they now lie and whatever object holds them: the fingerprint holds the
row count, each field's shape (per row) and dtype, and a SHA-256 of the
contents, never a path. Every source is hashed under one bound: the digest
covers every row when the data hold at most :data:`FULL_BYTES`, else
:data:`SAMPLED_ROWS` rows evenly spread over the data set plus the sizes (a
rewrite of the same shape is caught unless it leaves every sampled row as it
was), and the fingerprint says which (``covers``). So a small data set's
identity is exact whether arrays, a memmap, a Hugging Face ``Dataset``, a grain
``MapDataset`` or a list of records hold it.

- Array fields are hashed at construction, every byte a pass over the data
  (0.83 s per GB, so at most about 0.22 s; 1.4 ms for the sampled rows of a
  512 MiB memmap in the page cache).
- A Hugging Face ``Dataset`` is hashed as the loader reads it, numpy batches of
  rows (so any of its formats gives one digest), at its first checkpoint or
  restore. Its own ``_fingerprint`` is not used: it names the transforms that
  made the dataset, not its contents, and is private.
- A record-by-record source (a grain ``MapDataset``, a torch ``Dataset``, any
  object with ``__len__`` and ``__getitem__``) is hashed record by record as it
  returns them (no transform), read in batches where it has a batched read, at
  its first checkpoint or restore: each record is a Python call that may fail
  (then no digest is kept). The bound is judged by record 0's bytes times the
  row count, as for a Hugging Face ``Dataset``.

Figures: medians of ``benchmarks/studies/check_costs.py`` on a 2-core AMD EPYC.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

FULL_BYTES = 256 * 2**20  # data up to this size are hashed whole, any source
SAMPLED_ROWS = 1024  # rows (or records) hashed of larger data
_CHUNK_BYTES = 16 * 2**20  # read and hashed at a time


class DataChangedError(ValueError):
    """A file behind a memmapped field changed while the loader reads it."""


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def source_name(source: Any) -> str:
    """What holds the data, in words, for the error that refuses other data."""
    if _is_array(source) or isinstance(source, (dict, tuple)):
        kinds = {type(a) for a in jax.tree.leaves(source, is_leaf=_is_array)}
        return "array fields (" + ", ".join(sorted(_type_name(k) for k in kinds)) + ")"
    for cls in type(source).__mro__:
        library = (cls.__module__ or "").partition(".")[0]
        if (library, cls.__name__) == ("grain", "MapDataset"):
            return f"a grain MapDataset ({type(source).__name__})"
        if (library, cls.__name__) == ("datasets", "Dataset"):
            return "a Hugging Face datasets.Dataset"
    return f"a {_type_name(type(source))} of records"


def _type_name(cls: type) -> str:
    module = cls.__module__ or ""
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def fingerprint(fields: Any, length: int) -> dict[str, Any]:
    """The fingerprint of array ``fields`` (a tree of arrays, ``length`` rows each): every
    byte if they hold at most :data:`FULL_BYTES`, else :data:`SAMPLED_ROWS` rows."""
    digest = hashlib.sha256()
    named = jax.tree_util.tree_leaves_with_path(fields, is_leaf=_is_array)
    described = {
        jax.tree_util.keystr(path): _describe(leaf.shape[1:], leaf.dtype) for path, leaf in named
    }
    size = sum(length * math.prod(leaf.shape[1:]) * np.dtype(leaf.dtype).itemsize
               for _, leaf in named)  # fmt: skip
    whole = size <= FULL_BYTES
    rows = None if whole else _sampled(length)
    for _, leaf in named:
        _hash_field(digest, leaf, length, rows)
    covers = "every byte" if whole else f"{len(rows)} sampled rows"
    return {"rows": length, "fields": described, "digest": digest.hexdigest(),
            "covers": covers, "source": source_name(fields)}  # fmt: skip


def batched_fingerprint(
    read: Callable[[np.ndarray], Any], length: int, *, source: Any = None
) -> dict[str, Any]:
    """The fingerprint of a source read a batch at a time: ``read(rows)`` a tree of arrays
    (rows on the leading axis), ``length`` rows, ``source`` the object (named in a refusal).
    Every row is hashed if the fields of ``length`` rows like row 0 hold at most
    :data:`FULL_BYTES`, in chunks of about 16 MiB; else :data:`SAMPLED_ROWS` rows evenly
    spread, in one read."""
    first = jax.tree_util.tree_leaves_with_path(read(np.zeros(1, np.int64)))
    described = {jax.tree_util.keystr(p): _describe(a.shape[1:], a.dtype) for p, a in first}
    chunks, covers = _chunks(length, sum(_nbytes(a) for _, a in first), "row")
    digest = hashlib.sha256()
    for rows in chunks:
        for leaf in jax.tree.leaves(read(rows)):
            array = np.asarray(leaf)
            for value in array if array.dtype.hasobject else [array]:
                _hash_value(digest, value, np.asarray(value))
    return {"rows": length, "fields": described, "digest": digest.hexdigest(),
            "covers": covers, "source": source_name(source)}  # fmt: skip


def records_fingerprint(
    source: Any, length: int, *, batched: Callable[[list[int]], Sequence[Any]] | None = None
) -> dict[str, Any]:
    """The fingerprint of a record-by-record source: ``source[i]`` each record (or
    ``batched(rows)`` the records of ``rows`` together), ``length`` records. Every record
    is hashed if ``length`` records like record 0 hold at most :data:`FULL_BYTES`, else
    :data:`SAMPLED_ROWS` records evenly spread. A read that raises leaves the digest out
    (``covers`` says which): the loop raises it again at its call."""

    def read(rows: np.ndarray) -> Sequence[Any]:
        if batched is not None:
            return batched(rows.tolist())
        return [source[int(i)] for i in rows]

    described: dict[str, str] = {}
    structures: set[Any] = set()
    digest = hashlib.sha256()
    nothing = {"rows": length, "fields": {}, "digest": None, "source": source_name(source)}
    try:
        first = read(np.zeros(1, np.int64))[0]
    except Exception as e:  # raised again where the loop reads it, at its call
        return {**nothing, "covers": f"nothing (record 0 raised {type(e).__name__})"}
    row_bytes = sum(_nbytes(np.asarray(leaf)) for leaf in jax.tree.leaves(first))
    chunks, covers = _chunks(length, row_bytes, "record")
    for rows in chunks:
        try:
            records = read(rows)
        except Exception as e:
            return {**nothing, "covers": f"nothing (records {int(rows[0])} to "
                    f"{int(rows[-1])} raised {type(e).__name__})"}  # fmt: skip
        for record in records:
            leaves, structure = jax.tree.flatten(record)
            if structure not in structures:  # named once per structure: a third of the cost
                structures.add(structure)
                for path, leaf in jax.tree_util.tree_leaves_with_path(record):
                    array = np.asarray(leaf)
                    name = jax.tree_util.keystr(path)
                    described.setdefault(name, _describe(array.shape, array.dtype))
            for leaf in leaves:
                _hash_value(digest, leaf, np.asarray(leaf))
    return {**nothing, "fields": described, "digest": digest.hexdigest(), "covers": covers}


def _chunks(length: int, row_bytes: int, unit: str) -> tuple[list[np.ndarray], str]:
    """The reads that hash a source of ``length`` rows like one of ``row_bytes``: every
    row in reads of about 16 MiB up to :data:`FULL_BYTES`, else one of the sampled rows;
    and what they cover, in words."""
    row_bytes = max(1, row_bytes)
    if length * row_bytes > FULL_BYTES:
        rows = _sampled(length)
        return [rows], f"{len(rows)} sampled {unit}s"
    step = max(1, _CHUNK_BYTES // row_bytes)
    reads = [np.arange(i, min(i + step, length)) for i in range(0, length, step)]
    return reads, f"every {unit}"


def _nbytes(array: np.ndarray) -> int:
    """Bytes of an array, counting the arrays an object array holds (ragged lists)."""
    if not array.dtype.hasobject:
        return array.nbytes
    return sum(np.asarray(v).nbytes for v in array.ravel())


def difference(saved: dict[str, Any], here: dict[str, Any]) -> str | None:
    """What differs between two fingerprints, in words, naming the source now (and the
    one saved, if another kind); None if they match. Digests are compared where both
    cover the same rows (a fingerprint from before a change of the bound is not)."""
    if saved["rows"] != here["rows"]:
        changed = f"{saved['rows']} rows then, {here['rows']} now"
    elif saved["fields"] != here["fields"]:
        changed = "fields (shape per row, dtype) " + "; ".join(
            f"{name}: {saved['fields'].get(name, 'absent')} then, "
            f"{here['fields'].get(name, 'absent')} now"
            for name in sorted(set(saved["fields"]) | set(here["fields"]))
            if saved["fields"].get(name) != here["fields"].get(name)
        )
    elif (
        None not in (saved["digest"], here["digest"])
        and saved.get("covers") == here.get("covers")
        and saved["digest"] != here["digest"]
    ):
        changed = (
            f"the same shapes with other contents (SHA-256 of {here['covers']}: "
            f"{saved['digest'][:16]}... then, {here['digest'][:16]}... now)"
        )
    else:
        return None
    if "source" not in here:
        return changed
    then = saved.get("source")
    was = f", saved from {then}" if then not in (None, here["source"]) else ""
    return f"{changed}; the source is {here['source']}{was}"


def _describe(shape: tuple[int, ...], dtype: Any) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


def _sampled(length: int) -> np.ndarray:
    count = min(length, SAMPLED_ROWS)
    return np.unique(np.linspace(0, length - 1, count).round().astype(np.int64))


def _hash_field(digest: Any, leaf: Any, length: int, rows: np.ndarray | None) -> None:
    if rows is not None:
        digest.update(np.ascontiguousarray(np.asarray(leaf[rows])).data)
        return
    row_bytes = max(1, math.prod(leaf.shape[1:]) * np.dtype(leaf.dtype).itemsize)
    step = max(1, _CHUNK_BYTES // row_bytes)
    for start in range(0, length, step):
        block = np.asarray(leaf[np.arange(start, min(start + step, length))])
        digest.update(np.ascontiguousarray(block).data)


def _hash_value(digest: Any, leaf: Any, array: np.ndarray) -> None:
    digest.update(f"{array.dtype.str}{array.shape}".encode())
    if array.dtype.hasobject:  # an image object, a ragged list: its text form
        digest.update(repr(leaf).encode())
    else:
        digest.update(np.ascontiguousarray(array).data)


# ---- files behind memmaps -------------------------------------------------------------


def memmapped_files(fields: Any | None) -> dict[str, tuple[int, int]]:
    """``path -> (size, mtime_ns)`` of the files behind ``fields``' memmaps (a memmap, or
    an object whose ``base`` is one: a view such as ``jaxdp train``'s row subsets)."""
    files: dict[str, tuple[int, int]] = {}
    for leaf in jax.tree.leaves(fields, is_leaf=_is_array) if fields is not None else []:
        memmap = leaf if isinstance(leaf, np.memmap) else getattr(leaf, "base", None)
        if isinstance(memmap, np.memmap) and memmap.filename:
            files[memmap.filename] = _stat(memmap.filename)
    return files


def check_files(files: dict[str, tuple[int, int]]) -> None:
    """Raises :class:`DataChangedError` if a file of :func:`memmapped_files` changed.

    One ``os.stat`` per file (3.1 µs, ``benchmarks/studies/check_costs.py`` on a 2-core AMD
    EPYC), before each call's read: a memmap
    of a shrunk file would end the process with a bus error, one rewritten in
    place would hand out other data.
    """
    for path, (size, mtime) in files.items():
        now = _stat(path)
        if now != (size, mtime):
            what = f"size {size} -> {now[0]} bytes" if now[0] != size else "rewritten in place"
            raise DataChangedError(
                f"data file {path} changed while the loader reads it ({what}); the rows from "
                "here on would be other data (or, in a shrunk file, crash the process). The "
                "position so far is intact; restore the file, or start a new run on the new data"
            )


def _stat(path: str) -> tuple[int, int]:
    try:
        status = os.stat(path)
    except OSError:
        return (-1, -1)
    return (status.st_size, status.st_mtime_ns)


def read_rows(array: Any, rows: np.ndarray) -> np.ndarray:
    """``array[rows]``; of a memmap, read from its file with positioned reads
    (``os.preadv``, a run of consecutive rows at a time), not through the mapping.

    A file that shrinks while a read is under way (between :func:`check_files` and
    the read: another process truncating or rewriting it) then gives a short read,
    raised as :class:`DataChangedError`, where copying from a mapped page past the
    file's end ends the process with a bus error (SIGBUS) and nothing said. The
    bytes are the ones the mapping would give. Rows that are not whole blocks of
    the file (a view with strided rows) are read through the mapping.
    """
    root = array
    while isinstance(getattr(root, "base", None), np.memmap):
        root = root.base
    if not isinstance(array, np.memmap) or not getattr(root, "filename", None):
        return np.asarray(array[rows])
    rows = np.asarray(rows, np.int64)
    row_shape = array.shape[1:]
    row_bytes = array.itemsize * math.prod(row_shape)
    c_row = np.empty((1, *row_shape), array.dtype).strides[1:]  # a C-contiguous row's strides
    if array.strides[1:] != c_row or (len(rows) and rows.min() < 0):
        return np.asarray(array[rows])
    out = np.empty((len(rows), *row_shape), array.dtype)
    if out.size == 0:
        return out
    view = memoryview(out.reshape(-1).view(np.uint8))
    first = root.offset + (array.ctypes.data - root.ctypes.data)  # file position of row 0
    # One read per run of consecutive rows (each row alone where rows lie apart in the file).
    together = array.strides[0] == row_bytes
    starts = np.flatnonzero(np.diff(rows) != 1) + 1 if together else np.arange(1, len(rows))
    bounds = [0, *starts.tolist(), len(rows)]
    fd = os.open(root.filename, os.O_RDONLY)
    try:
        for k, end in zip(bounds[:-1], bounds[1:], strict=True):
            at, want = first + int(rows[k]) * array.strides[0], (end - k) * row_bytes
            got = os.preadv(fd, [view[k * row_bytes : end * row_bytes]], at)
            if got != want:
                raise DataChangedError(
                    f"data file {root.filename} changed while the loader reads it (a read of "
                    f"{want} bytes at {at} got {got}: the file is shorter than when it was "
                    "opened); the position so far is intact; restore the file, or start a new "
                    "run on the new data"
                )
    finally:
        os.close(fd)
    return out

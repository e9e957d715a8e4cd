"""The data of ``jaxdp train``: scikit-learn's digits (shipped with the package, no
download), a user's ``.npz`` with arrays ``x`` and ``y``, or a directory holding
``x.npy`` and ``y.npy``, read as memmaps (``--data``)."""

from __future__ import annotations

import gzip
import importlib.util
import math
import pathlib
import zipfile
import zlib
from typing import IO, Any, NamedTuple

import numpy as np


class Rows:
    """Rows ``index`` of ``base`` (an array or a memmap), read on demand as ``dtype``.

    What the loader reads from: ``rows[i]`` reads ``base[index[i]]`` only, so a
    memmap's held-out split and a float64 run's cast cost no copy of the data set.
    """

    def __init__(self, base: Any, index: np.ndarray, dtype: Any):
        self.base, self.index, self.dtype = base, index, np.dtype(dtype)
        self.shape = (len(index), *base.shape[1:])

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, rows: Any) -> np.ndarray:
        index = self.index[rows]
        if isinstance(self.base, np.memmap) and np.ndim(index) == 1:
            # From the file, not the mapping: a file shrunk under the run raises
            # DataChangedError where a mapped read would end the process (SIGBUS).
            from jaxdp.data._fingerprint import read_rows

            return np.asarray(read_rows(self.base, index), self.dtype)
        return np.asarray(self.base[index], self.dtype)


class Split(NamedTuple):
    """Train and held-out rows (float features or images, views of the data) and labels."""

    x_train: Rows
    y_train: np.ndarray
    x_test: Rows
    y_test: np.ndarray
    num_classes: int = 10  # the model's outputs: labels are in [0, num_classes)


def split(
    x: Any, y: np.ndarray, *, test_fraction: float, seed: int, dtype: Any, num_classes: int = 10
) -> Split:
    """Train and held-out rows of ``x`` by a fixed shuffle: the last ``test_fraction``."""
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(round(len(x) * (1.0 - test_fraction)))
    train, test = order[:cut], order[cut:]
    return Split(Rows(x, train, dtype), y[train], Rows(x, test, dtype), y[test], num_classes)


def load_digits(
    *, test_fraction: float = 0.2, seed: int = 0, dtype: Any = np.float32, images: bool = False
) -> Split:
    """The 1,797 8x8 handwritten digits (UCI optdigits test set, bundled with
    scikit-learn, read from disk: no download), pixels scaled to [0, 1], split
    into train and held-out test rows with a fixed shuffle: rows of 64 pixels, or
    with ``images`` images ``[n, 8, 8, 1]`` (row-major: the same numbers)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} must be in (0, 1)")
    data, target = _digits()
    x = (data / 16.0).astype(np.float32)
    if images:
        x = x.reshape(-1, 8, 8, 1)
    y = target.astype(np.int32)
    return split(x, y, test_fraction=test_fraction, seed=seed, dtype=dtype)


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as its ``load_digits`` reads them (the same file, the same
    ``np.loadtxt``: the same arrays, tests/test_cli_input.py checks), without importing
    scikit-learn: that import (scipy.stats with it) added 1.2 s to every ``jaxdp train``
    start after jaxdp's own imports (2 idle AMD EPYC cores; 2 to 4 s on a busy machine),
    against 0.03 s for this read. Falls back on
    ``sklearn.datasets.load_digits`` where a scikit-learn keeps the file elsewhere."""
    spec = importlib.util.find_spec("sklearn")  # finds the package, runs none of it
    folders = spec.submodule_search_locations if spec else None
    path = pathlib.Path(next(iter(folders or ["?"])), "datasets", "data", "digits.csv.gz")
    if not path.is_file():
        from sklearn.datasets import load_digits as sklearn_digits

        digits = sklearn_digits()
        return digits.data, digits.target
    with gzip.open(path, mode="rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int, copy=False)


def load_file(
    path: str,
    *,
    model: str,
    test_fraction: float = 0.2,
    seed: int = 0,
    dtype: Any = np.float32,
    num_classes: int | None = None,
) -> Split:
    """A user's classification data: ``x`` (rows of features, or images ``[n, h, w]`` or
    ``[n, h, w, c]``) and integer labels ``y`` in ``[0, classes)``, split as the digits are.

    ``path`` is a ``.npz`` holding arrays ``x`` and ``y`` (read into memory), or a
    directory holding ``x.npy`` and ``y.npy`` (``x`` opened as a memmap: only the
    rows of each batch are read). For the MLP the features are flattened; for
    the CNN ``x`` must be images of even height and width (a channel axis of 1 is
    added to ``[n, h, w]``; rows of features are refused).
    The classes are ``num_classes``, else the largest label + 1.

    Raises ``ValueError`` naming the path, the array and the rule, before any
    large read: missing, not an ``.npz`` or such a directory, a file cut short
    (an array's header declaring more bytes than follow it), arrays of objects
    or strings, lengths that differ, rows without features, labels outside
    ``[0, 2**31)`` or ``[0, num_classes)`` (naming the rows), inferred classes
    most of which have no row, ``x`` that is not images of even height and width for
    the CNN, non-finite ``x`` (naming the rows; checked where ``x`` holds at most
    :data:`CHECKED_BYTES`), too few rows to split.
    """
    x, y = _read(path)
    where = f"data={path!r}"
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
        raise ValueError(
            f"{where}: x has shape {x.shape} and y {y.shape}; x needs a row per label "
            "and at least one feature axis, y one label per row"
        )
    if math.prod(x.shape[1:]) == 0:
        raise ValueError(f"{where}: x has shape {x.shape}; every row needs at least one feature")
    if x.dtype.kind not in "biuf":
        raise ValueError(f"{where}: x has dtype {x.dtype}; it must hold numbers (ints or floats)")
    # The MLP's rows: a view of a memmap, nothing read.
    x = _images(where, x) if model == "cnn" else x.reshape(len(x), -1)
    y = np.asarray(y)
    if y.dtype.kind not in "iu":
        raise ValueError(f"{where}: y must hold class indices (integers >= 0), got {y.dtype}")
    classes = _classes(where, y, num_classes)
    _check_finite(where, x)
    cut = int(round(len(x) * (1.0 - test_fraction)))
    if cut < 1 or cut == len(x):
        raise ValueError(f"{where} has {len(x)} rows, too few for a held-out split")
    y = y.astype(np.int32)  # exact: checked below 2**31 above
    return split(x, y, test_fraction=test_fraction, seed=seed, dtype=dtype, num_classes=classes)


def _images(where: str, x: np.ndarray) -> np.ndarray:
    """``x`` as the CNN's images ``[n, h, w, channels]`` (a channel axis of 1 added to
    ``[n, h, w]``), refused unless its height and width are even (its 2x2 max-pool)."""
    if x.ndim not in (3, 4):
        flat = " (rows of features: --model mlp, or save x as its images)" if x.ndim == 2 else ""
        raise ValueError(
            f"{where}: x has shape {x.shape}; --model cnn needs images [n, h, w] or "
            f"[n, h, w, channels]{flat}"
        )
    if x.shape[1] % 2 or x.shape[2] % 2:
        raise ValueError(
            f"{where}: x has shape {x.shape}; --model cnn needs an even height and width "
            f"(a 2x2 max-pool follows its first convolution), got {x.shape[1]}x{x.shape[2]}"
        )
    return x[..., None] if x.ndim == 3 else x


# Checked for NaN and Inf at start (a pass over the data: 0.016 s per 100 MB, the
# median of benchmarks/studies/check_costs.py on a 2-core AMD EPYC);
# a larger x is not, and its non-finite rows show as skipped steps.
CHECKED_BYTES = 256 * 2**20
_SHOWN = 5  # offending rows named in an error


def _rows(where: np.ndarray, values: np.ndarray | None = None) -> str:
    shown = [f"row {i}" + (f" ({values[i]})" if values is not None else "") for i in where[:_SHOWN]]
    more = f" and {len(where) - _SHOWN} more" if len(where) > _SHOWN else ""
    return ", ".join(shown) + more


def _classes(where: str, y: np.ndarray, num_classes: int | None) -> int:
    """The number of classes, from ``num_classes`` or the labels; refuses labels that do not
    fit (naming the rows) and inferred classes most of which no row has."""
    top = num_classes if num_classes is not None else 2**31
    bad = np.flatnonzero((y < 0) | (y >= top))
    if len(bad):
        rule = f"--num-classes {num_classes}" if num_classes is not None else "int32"
        raise ValueError(
            f"{where}: y holds {len(bad)} label(s) outside [0, {top}) ({rule}): {_rows(bad, y)}"
        )
    if num_classes is not None:
        return num_classes
    classes = int(y.max()) + 1
    present = np.unique(y)
    if 2 * len(present) < classes:
        listed = ", ".join(str(v) for v in present[:8]) + (" ..." if len(present) > 8 else "")
        raise ValueError(
            f"{where}: the largest label is {classes - 1}, so {classes} classes, but only "
            f"{len(present)} of them have a row ({listed}): a stray label "
            f"({_rows(np.flatnonzero(y == y.max()), y)})? Pass --num-classes {classes} if "
            "that many classes is right"
        )
    return classes


def _check_finite(where: str, x: np.ndarray) -> None:
    if x.dtype.kind != "f" or x.nbytes > CHECKED_BYTES:
        return
    row_bytes = max(1, x.nbytes // max(1, len(x)))
    step = max(1, (16 * 2**20) // row_bytes)
    bad = []
    for start in range(0, len(x), step):
        block = np.asarray(x[start : start + step])
        finite = np.isfinite(block).reshape(len(block), -1).all(axis=1)
        bad.append(start + np.flatnonzero(~finite))
    rows = np.concatenate(bad) if bad else np.zeros(0, np.int64)
    if len(rows):
        raise ValueError(
            f"{where}: x holds NaN or Inf in {len(rows)} row(s): {_rows(rows)}; every step "
            "that reads one would be skipped. Remove or fill them"
        )


def _read(path: str) -> tuple[np.ndarray, np.ndarray]:
    """``x`` and ``y`` of a ``.npz`` or of a directory's ``x.npy`` and ``y.npy`` (memmaps),
    each array's header checked against the bytes that follow it before it is read."""
    where = pathlib.Path(path)
    if where.is_dir():
        files = [where / "x.npy", where / "y.npy"]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(
                f"data={path!r} is a directory without {missing}; it needs x.npy (features or "
                "images) and y.npy (integer labels)"
            )
        for f in files:
            with open(f, "rb") as stream:
                _check_header(f"data={path!r}: {f.name}", stream, f.stat().st_size)
        try:
            x, y = (np.load(f, mmap_mode="r", allow_pickle=False) for f in files)
        except (OSError, ValueError) as e:
            raise ValueError(f"data={path!r}: not an .npy file numpy can read: {e}") from None
        return x, y
    if not where.is_file():
        raise ValueError(f"data={path!r} does not exist (or is not a file or a directory)")
    with open(where, "rb") as stream:
        magic = stream.read(6)
    if magic == b"\x93NUMPY":
        raise ValueError(
            f"data={path!r} holds one array, not a .npz with arrays x and y (or a directory "
            "with x.npy and y.npy)"
        )
    try:
        with zipfile.ZipFile(where) as archive:
            names = set(archive.namelist())
            missing = [k for k in ("x", "y") if f"{k}.npy" not in names]
            if missing:
                found = sorted(n.removesuffix(".npy") for n in names)
                raise ValueError(
                    f"data={path!r} has arrays {found}; it needs x (features or images) and y "
                    f"(integer labels), missing {missing}"
                )
            arrays = []
            for name in ("x", "y"):
                size = archive.getinfo(f"{name}.npy").file_size
                with archive.open(f"{name}.npy") as stream:
                    _check_header(f"data={path!r}: array {name}", stream, size)
                with archive.open(f"{name}.npy") as stream:
                    arrays.append(np.lib.format.read_array(stream, allow_pickle=False))
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise ValueError(
            f"data={path!r} is not a .npz file numpy can read (a zip of .npy arrays; cut short "
            f"or corrupted?): {type(e).__name__}: {e}"
        ) from None
    return arrays[0], arrays[1]


def _check_header(name: str, stream: IO[bytes], size: int) -> None:
    """Refuses an ``.npy`` stream whose header is unreadable, declares objects, or
    declares more bytes than the ``size``-byte file holds after it (a 10**12-row header
    on a small file: never allocated)."""
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(stream)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(stream)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{name} is not an .npy array numpy can read: {e}") from None
    if dtype.hasobject:
        raise ValueError(f"{name} has dtype {dtype} (Python objects); it must hold numbers")
    declared = math.prod(shape) * dtype.itemsize
    held = size - stream.tell()
    if held < declared:
        raise ValueError(
            f"{name} declares shape {shape} of {dtype} ({_bytes(declared)}), but the file "
            f"holds {_bytes(held)} after its header: cut short or corrupted"
        )


def _bytes(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError

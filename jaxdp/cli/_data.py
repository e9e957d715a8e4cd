"""The data of ``jaxdp train``: scikit-learn's digits (shipped with the package, no
download), a user's ``.npz`` with arrays ``x`` and ``y``, or a directory holding
``x.npy`` and ``y.npy``, read as memmaps (``--data``)."""

from __future__ import annotations

import pathlib
from typing import Any, NamedTuple

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
        return np.asarray(self.base[self.index[rows]], self.dtype)


class Split(NamedTuple):
    """Train and held-out rows (float features or images, views of the data) and labels."""

    x_train: Rows
    y_train: np.ndarray
    x_test: Rows
    y_test: np.ndarray


def split(x: Any, y: np.ndarray, *, test_fraction: float, seed: int, dtype: Any) -> Split:
    """Train and held-out rows of ``x`` by a fixed shuffle: the last ``test_fraction``."""
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(round(len(x) * (1.0 - test_fraction)))
    train, test = order[:cut], order[cut:]
    return Split(Rows(x, train, dtype), y[train], Rows(x, test, dtype), y[test])


def load_digits(*, test_fraction: float = 0.2, seed: int = 0, dtype: Any = np.float32) -> Split:
    """The 1,797 8x8 handwritten digits (UCI optdigits test set, bundled with
    scikit-learn, read from disk: no download), pixels scaled to [0, 1], split
    into train and held-out test rows with a fixed shuffle."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} must be in (0, 1)")
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    return split(x, y, test_fraction=test_fraction, seed=seed, dtype=dtype)


def load_file(
    path: str, *, model: str, test_fraction: float = 0.2, seed: int = 0, dtype: Any = np.float32
) -> Split:
    """A user's classification data: ``x`` (rows of features, or images ``[n, h, w]`` or
    ``[n, h, w, c]``) and integer labels ``y`` in ``[0, classes)``, split as the digits are.

    ``path`` is a ``.npz`` holding arrays ``x`` and ``y`` (read into memory), or a
    directory holding ``x.npy`` and ``y.npy`` (``x`` opened as a memmap: only the
    rows of each batch are read). For the MLP the features are flattened; for
    the CNN ``x`` must be images (a channel axis of 1 is added to ``[n, h, w]``).
    Raises ``ValueError`` naming the path and the rule: missing, not an ``.npz``
    or such a directory, without ``x`` or ``y``, lengths that differ, labels that
    are not non-negative integers, too few rows to split.
    """
    x, y = _read(path)
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
        raise ValueError(
            f"data={path!r}: x has shape {x.shape} and y {y.shape}; x needs a row per label "
            "and at least one feature axis, y one label per row"
        )
    y = np.asarray(y)
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
        raise ValueError(f"data={path!r}: y must hold class indices (integers >= 0), got {y.dtype}")
    if model == "cnn":
        if x.ndim not in (3, 4):
            raise ValueError(
                f"data={path!r}: x has shape {x.shape}; --model cnn needs images [n, h, w] or "
                "[n, h, w, channels]"
            )
        x = x[..., None] if x.ndim == 3 else x
    else:
        x = x.reshape(len(x), -1)  # a view of a memmap: nothing read
    cut = int(round(len(x) * (1.0 - test_fraction)))
    if cut < 1 or cut == len(x):
        raise ValueError(f"data={path!r} has {len(x)} rows, too few for a held-out split")
    return split(x, y.astype(np.int32), test_fraction=test_fraction, seed=seed, dtype=dtype)


def _read(path: str) -> tuple[np.ndarray, np.ndarray]:
    """``x`` and ``y`` of a ``.npz`` or of a directory's ``x.npy`` and ``y.npy`` (memmaps)."""
    where = pathlib.Path(path)
    if where.is_dir():
        files = [where / "x.npy", where / "y.npy"]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(
                f"data={path!r} is a directory without {missing}; it needs x.npy (features or "
                "images) and y.npy (integer labels)"
            )
        try:
            x, y = (np.load(f, mmap_mode="r", allow_pickle=False) for f in files)
        except (OSError, ValueError) as e:
            raise ValueError(f"data={path!r}: not an .npy file numpy can read: {e}") from None
        return x, y
    if not where.is_file():
        raise ValueError(f"data={path!r} does not exist (or is not a file or a directory)")
    try:
        arrays = np.load(where, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"data={path!r} is not a .npz file numpy can read: {e}") from None
    if not isinstance(arrays, np.lib.npyio.NpzFile):
        raise ValueError(
            f"data={path!r} holds one array, not a .npz with arrays x and y (or a directory "
            "with x.npy and y.npy)"
        )
    with arrays:
        missing = [k for k in ("x", "y") if k not in arrays.files]
        if missing:
            raise ValueError(
                f"data={path!r} has arrays {sorted(arrays.files)}; it needs x (features or "
                f"images) and y (integer labels), missing {missing}"
            )
        return arrays["x"], arrays["y"]

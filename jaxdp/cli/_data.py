"""The data of ``jaxdp train``: scikit-learn's digits (shipped with the package, no
download), or a user's ``.npz`` with arrays ``x`` and ``y`` (``--data``)."""

from __future__ import annotations

import pathlib
from typing import NamedTuple

import numpy as np


class Split(NamedTuple):
    """Images as float32 rows in [0, 1] and integer labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits(*, test_fraction: float = 0.2, seed: int = 0) -> Split:
    """The 1,797 8x8 handwritten digits (UCI optdigits test set, bundled with
    scikit-learn, read from disk: no download), split into train and held-out
    test rows with a fixed shuffle."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} must be in (0, 1)")
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(round(len(x) * (1.0 - test_fraction)))
    train, test = order[:cut], order[cut:]
    return Split(x[train], y[train], x[test], y[test])


def load_npz(path: str, *, model: str, test_fraction: float = 0.2, seed: int = 0) -> Split:
    """A user's classification data: ``x`` (rows of features, or images ``[n, h, w]`` or
    ``[n, h, w, c]``) and integer labels ``y`` in ``[0, classes)``, split as the digits are.

    For the MLP the features are flattened; for the CNN ``x`` must be images (a
    channel axis of 1 is added to ``[n, h, w]``). Raises ``ValueError`` naming the
    file and the rule: missing, not an ``.npz``, without ``x`` or ``y``, lengths that
    differ, labels that are not non-negative integers, too few rows to split.
    """
    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(f"data={path!r} does not exist (or is not a file)")
    try:
        arrays = np.load(file, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"data={path!r} is not a .npz file numpy can read: {e}") from None
    if not isinstance(arrays, np.lib.npyio.NpzFile):
        raise ValueError(f"data={path!r} holds one array, not a .npz with arrays x and y")
    with arrays:
        missing = [k for k in ("x", "y") if k not in arrays.files]
        if missing:
            raise ValueError(
                f"data={path!r} has arrays {sorted(arrays.files)}; it needs x (features or "
                f"images) and y (integer labels), missing {missing}"
            )
        x, y = arrays["x"], arrays["y"]
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
        raise ValueError(
            f"data={path!r}: x has shape {x.shape} and y {y.shape}; x needs a row per label "
            "and at least one feature axis, y one label per row"
        )
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
        x = x.reshape(len(x), -1)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(round(len(x) * (1.0 - test_fraction)))
    if cut < 1 or cut == len(x):
        raise ValueError(f"data={path!r} has {len(x)} rows, too few for a held-out split")
    train, test = order[:cut], order[cut:]
    x, y = x.astype(np.float32), y.astype(np.int32)
    return Split(x[train], y[train], x[test], y[test])

"""Real data that ships with an installed package: scikit-learn's digits."""

from __future__ import annotations

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

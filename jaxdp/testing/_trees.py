"""One tree comparison, with tolerances named per dtype (the ``"same_sums"`` rows of
:mod:`jaxdp.testing._tolerances`)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ._tolerances import Tolerance, tolerances

TOLERANCES: dict[str, Tolerance] = tolerances("same_sums")
"""The tolerance of each dtype :func:`assert_trees_close` uses, with its reason."""


def tolerance_of(*dtypes: np.dtype) -> tuple[str, Tolerance]:
    """The named tolerance of the least precise of ``dtypes`` (float32 vs a float64
    reference compares at float32's)."""
    floats = [d for d in dtypes if jax.numpy.issubdtype(d, np.inexact)]
    if not floats:
        return "exact", TOLERANCES["exact"]
    coarsest = max(floats, key=lambda d: float(jax.numpy.finfo(d).eps))
    name = jax.numpy.finfo(coarsest).dtype.name
    if name not in TOLERANCES:
        raise ValueError(f"no tolerance named for dtype {name}; pass rtol= and atol=")
    return name, TOLERANCES[name]


def assert_trees_close(
    actual: Any, expected: Any, *, rtol: float | None = None, atol: float | None = None
) -> None:
    """Asserts the same tree structure, and each leaf of ``actual`` of the same shape and
    within tolerance of ``expected``'s, elementwise.

    The tolerance is :data:`TOLERANCES` of the less precise dtype of the two leaves
    (complex numbers by their parts' float), integers and booleans exact; ``rtol`` and
    ``atol`` replace it for every leaf. Leaves are read with ``np.asarray``: in a test of
    several processes, compare the arrays each process can address.

    Raises:
      AssertionError: naming the first leaf that differs (its path), its dtype, the
        tolerance and why, and numpy's count and worst of the elements out of it.
    """
    a_def, b_def = jax.tree.structure(actual), jax.tree.structure(expected)
    if a_def != b_def:
        raise AssertionError(
            f"the trees differ in structure:\n  actual   {a_def}\n  expected {b_def}"
        )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(actual)]
    for path, a, b in zip(paths, jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        where = path or "the leaf"
        if a.shape != b.shape:
            raise AssertionError(f"{where}: shape {a.shape} != expected {b.shape}")
        name, tol = tolerance_of(a.dtype, b.dtype)
        r = tol.rtol if rtol is None else rtol
        t = tol.atol if atol is None else atol
        told = f"{name}: rtol={r:g}, atol={t:g}"
        if rtol is None and atol is None:
            told += f", {tol.why}"
        try:
            np.testing.assert_allclose(a, b, rtol=r, atol=t, err_msg=f"{where} ({told})")
        except AssertionError as e:
            raise AssertionError(str(e).strip()) from None

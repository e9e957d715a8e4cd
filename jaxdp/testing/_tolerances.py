"""One table of tolerances: what each kind of comparison allows per dtype, and why.

Elementwise ``|actual - expected| <= atol + rtol * |expected|``. Two comparisons differ
in kind, so each has its rows (tests/core/test_testing_helpers.py holds them apart):

- ``"same_sums"``: jaxdp against jaxdp or a closed form (accumulated == one big batch,
  N devices == 1 device). The same float operations, only added in another order.
  :func:`jaxdp.testing.assert_trees_close` uses these.
- ``"torch_trajectory"``: jaxdp against PyTorch after each of several optimizer steps
  (:mod:`jaxdp.parity`). Two frameworks' kernels, and optimizer formulas reassociated
  (Adam's bias corrections), compounding over the steps.

This module imports nothing of jaxdp: the core's tests, :mod:`jaxdp.testing` and
:mod:`jaxdp.parity` all read it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Comparison = Literal["same_sums", "torch_trajectory"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Elementwise ``|actual - expected| <= atol + rtol * |expected|``, and why."""

    rtol: float
    atol: float
    why: str


TABLE: dict[tuple[Comparison, str], Tolerance] = {
    ("same_sums", "float64"): Tolerance(
        1e-12,
        1e-15,
        "the same sums in another order (micro-batches, then devices, against one big batch) "
        "differ by a few 1e-15 relative after several steps; 1e-15 absolute is a few ulps of 1.0",
    ),
    ("same_sums", "float32"): Tolerance(
        1.3e-6, 1e-5, "PyTorch's assert_close defaults; after 5 steps jaxdp saw 1.1e-6 at most"
    ),
    ("same_sums", "bfloat16"): Tolerance(
        1.6e-2, 1e-5, "PyTorch's assert_close defaults: 2 ulps of an 8-bit mantissa (eps 2^-7)"
    ),
    ("same_sums", "float16"): Tolerance(
        1e-3, 1e-5, "PyTorch's assert_close defaults: 1 ulp of a 10-bit mantissa (eps 2^-10)"
    ),
    ("same_sums", "exact"): Tolerance(
        0.0, 0.0, "integers and booleans: another order of the same sums cannot change them"
    ),
    ("torch_trajectory", "float64"): Tolerance(
        1e-10,
        1e-12,
        "the parity issue's bound: both frameworks compute in float64, only summation order "
        "and reassociated optimizer formulas differ (observed up to 1.6e-12 relative, the CNN's "
        "conv weights under clipping: 60x inside); 1e-12 absolute on O(0.1) parameters for "
        "elements passing through zero, where a relative error means nothing",
    ),
    ("torch_trajectory", "float32"): Tolerance(
        1.3e-6,
        1e-5,
        "PyTorch's assertEqual defaults for float32 (float32 matmuls at full precision on "
        "both sides); observed below 2e-6 absolute",
    ),
}
"""Every tolerance jaxdp's comparisons use: ``(comparison, dtype) -> Tolerance``."""


def tolerances(comparison: Comparison) -> dict[str, Tolerance]:
    """The rows of ``comparison``, by dtype name."""
    return {dtype: tol for (kind, dtype), tol in TABLE.items() if kind == comparison}

"""One tolerance table: jaxdp.testing and jaxdp.parity read their rows from it."""

import jaxdp.parity
from jaxdp.testing import TOLERANCES, Tolerance
from jaxdp.testing._tolerances import TABLE


def rows(comparison):
    return {dtype: tol for (kind, dtype), tol in TABLE.items() if kind == comparison}


def test_assert_trees_close_and_parity_read_one_table():
    assert rows("same_sums") == TOLERANCES
    assert {d: t.rtol for d, t in rows("torch_trajectory").items()} == jaxdp.parity.RTOL
    assert {d: t.atol for d, t in rows("torch_trajectory").items()} == jaxdp.parity.ATOL
    assert all(isinstance(t, Tolerance) and len(t.why) > 40 for t in TABLE.values())


def test_each_comparison_keeps_its_own_bounds():
    # A trajectory of two frameworks is not held to reordered sums' bounds, nor the
    # reverse: neither row loosened the other when they became one table.
    assert (TABLE["same_sums", "float64"].rtol, TABLE["same_sums", "float64"].atol) == (
        1e-12,
        1e-15,
    )
    torch64 = TABLE["torch_trajectory", "float64"]
    assert (torch64.rtol, torch64.atol) == (1e-10, 1e-12)
    for dtype, tol in rows("torch_trajectory").items():
        assert tol.rtol >= TABLE["same_sums", dtype].rtol, dtype

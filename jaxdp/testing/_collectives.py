"""The collectives of a compiled program as a contract: how many run per call, of each kind."""

from __future__ import annotations

from typing import Any

from .._inspect import collectives, format_report

_KINDS = {
    "all_reduce": "all-reduce",
    "reduce_scatter": "reduce-scatter",
    "all_gather": "all-gather",
}


def assert_collectives(
    compiled: Any,
    *,
    all_reduce: int | None = 0,
    reduce_scatter: int | None = 0,
    all_gather: int | None = 0,
) -> None:
    """Asserts how many collectives of each kind run per call of ``compiled``.

    Counts executions, not instructions: an all-reduce inside a ``lax.scan`` of 4
    steps counts 4 (see :func:`jaxdp.collectives`). A kind not named must not run at
    all; ``None`` leaves it unchecked. A collective inside a conditional branch, or a
    loop of unknown trip count, has no one count and fails the assertion.

    Args:
      compiled: ``jitted.lower(*args).compile()`` (for a jaxdp step:
        ``step.compile(state, batch)``) or its ``as_text()``.
      all_reduce, reduce_scatter, all_gather: the executions per call expected.

    Raises:
      ValueError: an expected count is not a non-negative integer.
      AssertionError: a count differs, with the table of every collective found.
    """
    found = collectives(compiled)
    expected = {
        "all_reduce": all_reduce,
        "reduce_scatter": reduce_scatter,
        "all_gather": all_gather,
    }
    wrong = []
    for arg, want in expected.items():
        if want is None:
            continue
        if type(want) is not int or want < 0:
            raise ValueError(f"{arg}={want!r} must be a non-negative integer or None")
        runs = [c.executions for c in found if c.kind == _KINDS[arg]]
        low, high = sum(lo for lo, _ in runs), sum(hi for _, hi in runs)
        if any(lo < 0 or lo != hi for lo, hi in runs):
            wrong.append(f"{arg}={want}: found {low}..{high} per call (a branch or unknown loop)")
        elif low != want:
            wrong.append(f"{arg}={want}: found {low} per call")
    if wrong:
        raise AssertionError("; ".join(wrong) + "\n" + format_report(found))

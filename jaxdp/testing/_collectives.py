"""The collectives of a compiled program as a contract: how many run per call, of each kind,
in all of its calls or in those that take one side of its conditionals."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, Literal

from .._inspect import _BRANCHES, _CALLEE, Collective, _parse, collectives, format_report

_KINDS = {
    "all_reduce": "all-reduce",
    "reduce_scatter": "reduce-scatter",
    "all_gather": "all-gather",
}
# A ``lax.cond`` lowers to a conditional of two branches, ``false_fun`` first (or, in
# XLA's predicated form, a ``true_computation`` and a ``false_computation``): a jaxdp
# step's ``lax.cond(ok, apply, keep)`` (the update, on CPU) and ``lax.cond(ends, ...)``
# (a multisteps window's end) put the work in the true branch and the state kept in the
# false one.
_CONDITIONAL = re.compile(r"^conditional (.+)\[(\d+)\]$")


@dataclasses.dataclass(frozen=True)
class Buckets:
    """What :func:`assert_collectives` expects of a kind whose collectives XLA combines
    into buckets: their bytes per call, and how much of them hides under compute.

    A jaxdp step's gradients travel so (``Parallel(bucket_cap_mb=...)``): on the
    window's last micro-batch only, in buckets that XLA:GPU schedules under the rest of
    its backward. How many buckets XLA makes is its choice (its combine threshold, the
    order the backward computes the leaves in); what they carry is not.

    Attributes:
      bytes: the bytes the collectives of the kind carry per call, all executions
        together (each collective's whole buffer, as :func:`jaxdp.testing.collectives`
        measures it): a step's gradient bytes (``accum_steps`` times them at ZeRO stage
        2, which reduce-scatters every micro-batch). A collective inside the micro-batch
        loop runs once per micro-batch, so a window's reduction there counts
        ``accum_steps`` times. None leaves them unchecked (what XLA moves may be narrower
        than the leaves: it gathers a weight the program casts to bfloat16 in bfloat16).
      extra: how many bytes more they may carry: the sums that ride with the gradients
        (the loss, the weight, ``aux``, batch statistics).
      hidden: the least share of those bytes in asynchronous collectives with a matrix
        product scheduled between their start and done (``Collective.products_under``);
        None leaves it unchecked. XLA:CPU runs collectives synchronously: nothing hides.
      exposed: which collectives are left out of that share (a predicate on a
        :class:`Collective`), those with no compute to hide under: the one carrying a
        gradient complete only at the end of the backward (a token embedding tied to the
        output head: ``lambda c: c.bytes >= tied_bytes``, a leaf larger than any bucket
        travels alone), a micro-batch's first gathers. Left out of both sides: a left-out
        collective that does hide counts for nothing, so the share is the others' own.
    """

    bytes: int | None
    extra: int = 2**16
    hidden: float | None = None
    exposed: Callable[[Collective], bool] | None = None


def assert_collectives(
    compiled: Any,
    *,
    all_reduce: int | Buckets | None = 0,
    reduce_scatter: int | Buckets | None = 0,
    all_gather: int | Buckets | None = 0,
    branch: Literal["applied", "skipped"] | None = None,
) -> None:
    """Asserts how many collectives of each kind run per call of ``compiled``.

    Counts executions, not instructions: an all-reduce inside a ``lax.scan`` of 4
    steps counts 4 (see :func:`jaxdp.testing.collectives`). A kind not named must not run at
    all; ``None`` leaves it unchecked. A :class:`Buckets` asserts the bytes the kind
    carries per call instead of a count, and how much of them hides under compute: a
    jaxdp step's gradient bytes travel once per optimizer step, on the window's last
    micro-batch, in the buckets XLA makes of them (``assert_collectives(compiled,
    all_reduce=Buckets(gradient_bytes, hidden=0.9))``; on XLA:CPU in one).

    A collective inside a conditional runs only when its branch is taken, so without
    ``branch`` it has no one count and fails the assertion ("found 0..1 per call").
    ``branch`` counts the calls that take one side of every conditional of the
    program: ``"applied"`` the true branch of each ``lax.cond`` (the update applied,
    a multisteps window ended), ``"skipped"`` the false one (a step skipped for
    non-finite gradients, a call inside a window); a collective in the other branch
    then runs 0 times, one outside every conditional as usual. So a jaxdp step's
    ``Parallel(zero_stage=1)`` "one reduce-scatter and one all-gather per step" reads
    ``assert_collectives(compiled, reduce_scatter=1, all_gather=1, all_reduce=None,
    branch="applied")``, and a skipped step gathers nothing (``all_gather=0,
    branch="skipped"``). Off CPU the update's skip is a select, not a branch: its
    collectives run in every call, and both sides count them.

    Args:
      compiled: ``jitted.lower(*args).compile()`` (for a jaxdp step:
        ``step.compile(state, batch)``) or its ``as_text()``.
      all_reduce, reduce_scatter, all_gather: the executions per call expected.
      branch: which side of every two-way conditional the counted calls take; None
        (the default): every call, so a collective in a branch fails.

    Raises:
      ValueError: an expected count is not a non-negative integer or None, ``branch``
        is not one of its values, or (with ``branch``) the program has a conditional
        of more than two branches (a ``lax.switch``), which has no applied side.
      AssertionError: a count differs, with the table of every collective found.
    """
    if branch not in (None, "applied", "skipped"):
        raise ValueError(f"branch={branch!r} must be 'applied', 'skipped' or None")
    hlo = compiled if isinstance(compiled, str) else compiled.as_text()
    found = collectives(hlo)
    ways = _branch_counts(hlo) if branch is not None else {}
    expected = {
        "all_reduce": all_reduce,
        "reduce_scatter": reduce_scatter,
        "all_gather": all_gather,
    }
    wrong = []
    for arg, want in expected.items():
        if want is None:
            continue
        if not isinstance(want, Buckets) and (type(want) is not int or want < 0):
            raise ValueError(f"{arg}={want!r} must be a non-negative integer, Buckets or None")
        kind = [c for c in found if c.kind == _KINDS[arg]]
        runs = [_runs(c, branch, ways) for c in kind]
        low, high = sum(lo for lo, _ in runs), sum(hi for _, hi in runs)
        if any(lo < 0 or lo != hi for lo, hi in runs):
            why = "an unknown loop" if branch else "a branch or unknown loop: see branch="
            wrong.append(f"{arg}={want}: found {low}..{high} per call ({why})")
        elif isinstance(want, Buckets):
            wrong += _bucket_faults(arg, want, kind, [lo for lo, _ in runs])
        elif low != want:
            wrong.append(f"{arg}={want}: found {low} per call")
    if wrong:
        taken = f" (calls that take the {branch} branch)" if branch else ""
        raise AssertionError("; ".join(wrong) + taken + "\n" + format_report(found))


def _bucket_faults(arg: str, want: Buckets, kind: list[Collective], runs: list[int]) -> list[str]:
    """What of ``want`` the collectives ``kind`` (each running ``runs[i]`` times a call)
    do not meet."""
    carried = sum(c.bytes * n for c, n in zip(kind, runs, strict=True))
    buckets = sum(1 for n in runs if n)
    faults = []
    if want.bytes is not None and not want.bytes <= carried <= want.bytes + want.extra:
        faults.append(
            f"{arg}={want}: its {buckets} bucket(s) carry {carried:,} bytes per call, not "
            f"{want.bytes:,} (+ at most {want.extra:,})"
        )
    counted = [(c, n) for c, n in zip(kind, runs, strict=True) if not _left_out(want, c)]
    counted_bytes = sum(c.bytes * n for c, n in counted)
    counted_hidden = sum(c.bytes * n for c, n in counted if c.overlapped)
    if want.hidden is not None and counted_hidden < want.hidden * counted_bytes:
        share = counted_hidden / counted_bytes if counted_bytes > 0 else 0.0
        left = " (the exposed ones left out)" if want.exposed is not None else ""
        faults.append(
            f"{arg}={want}: {share:.1%} of its bytes{left} have a matrix product "
            f"scheduled under them, not at least {want.hidden:.0%}"
        )
    return faults


def _left_out(want: Buckets, collective: Collective) -> bool:
    return want.exposed is not None and bool(want.exposed(collective))


def _branch_counts(hlo: str) -> dict[str, tuple[int, int]]:
    """``name -> (branches, index of the true branch)`` of each conditional of the program
    (the index as :func:`jaxdp.testing.collectives` numbers its branches in ``context``)."""
    _, computations = _parse(hlo)
    counts = {}
    for instructions in computations.values():
        for name, _, opcode, rest in instructions:
            if opcode != "conditional":
                continue
            listed = _BRANCHES.search(rest)
            if listed:  # an index: lax.cond's false_fun is branch 0
                counts[name] = (len(listed.group(1).split(",")), 1)
            else:  # a predicate: the branches in the order they are printed
                order = [k for k, _ in _CALLEE.findall(rest) if k.endswith("_computation")]
                counts[name] = (2, order.index("true_computation"))
    return counts


def _runs(
    collective: Collective, branch: str | None, ways: dict[str, tuple[int, int]]
) -> tuple[int, int]:
    """``collective``'s executions per call, in the calls that take ``branch``."""
    low, high = collective.executions
    if branch is None:
        return low, high
    for where in collective.context:
        conditional = _CONDITIONAL.match(where)
        if conditional is None:
            continue
        count, true = ways[conditional.group(1)]
        if count > 2:
            raise ValueError(
                f"branch={branch!r}: conditional {conditional.group(1)} has more than two "
                "branches (a lax.switch): it has no applied and skipped side"
            )
        if (int(conditional.group(2)) == true) != (branch == "applied"):
            return 0, 0
    return high, high  # every conditional around it taken: its loops' count

"""Inspection of compiled steps: which collectives (all-reduce, reduce-scatter,
all-gather) run, how often, how big, and which matrix products run under them.

Reads the optimized HLO text of a compiled executable. An all-reduce at the
top level runs once per call, one inside a ``while`` body runs once per
iteration (XLA records the trip count of a ``lax.scan`` loop), and one inside
a ``conditional`` branch runs at most once, only when that branch is taken.

A compiled program is scheduled: each computation lists its instructions in the
order they run. XLA:GPU splits a collective it runs asynchronously into a start and
a done (``all-reduce-start`` ... ``all-reduce-done``); what is scheduled between the
two runs while the collective is in flight. It also wraps a collective in a collective
fusion (``fusion-start`` ... ``fusion-done``, calling a computation that holds the
collective: a Triton all-reduce of a small bucket); that collective is counted as any
other, in flight between the fusion's start and done. XLA:CPU runs every collective
synchronously: nothing runs under it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
# Optimized HLO names computations with a %; the unoptimized text of
# ``lowered.compiler_ir("hlo").as_hlo_text()`` (before XLA's passes) does not.
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*->.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_CALLEE = re.compile(
    r"\b(condition|body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# jax 0.12 prints a mesh and the axes a collective spans: mesh['data'=4] {'data'}.
# With a device order of its own: mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}.
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[[\d,]+\](?:T\([\d,]+\))?\))?"
    r"\s*\{([^}]*)\}"
)
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")
_KINDS = {
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
    "reduce-scatter": "reduce-scatter",
    "reduce-scatter-start": "reduce-scatter",
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
}
# What a matrix product is in a compiled program: the op, or XLA:GPU's library call.
_PRODUCTS = frozenset({"dot", "convolution", "ragged-dot"})
_PRODUCT_CALL = re.compile(r'custom_call_target="[^"]*(gemm|matmul|conv)[^"]*"', re.IGNORECASE)
_OPERAND = re.compile(r"^\s*%?([\w.\-]+)")
# The instructions whose called computation runs as part of them: a collective fusion
# (``fusion-start``) holds its collective there.
_CALLERS = ("call", "fusion", "fusion-start", "async-start")


class _Placed:
    """Where an instruction sits, from its ``context`` (the enclosing computations)."""

    context: tuple[str, ...]

    @property
    def in_loop(self) -> bool:
        return any(c.startswith("while") for c in self.context)

    @property
    def in_conditional(self) -> bool:
        return any(c.startswith("conditional") for c in self.context)


@dataclasses.dataclass(frozen=True)
class AllReduce(_Placed):
    """One all-reduce instruction of a compiled program.

    ``bytes`` is the payload of one execution (all operands: XLA's combiner
    merges per-leaf all-reduces into one instruction with many operands).
    ``executions`` is how often it runs per call of the program: the product of
    the trip counts of the loops around it, as ``(min, max)``; inside a
    conditional branch the minimum is 0.
    """

    name: str
    bytes: int
    shapes: tuple[str, ...]
    context: tuple[str, ...]
    executions: tuple[int, int]


def _array_bytes(type_text: str) -> tuple[int, tuple[str, ...]]:
    total, shapes = 0, []
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype not in _BYTES:
            continue
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _BYTES[dtype]
        shapes.append(f"{dtype}[{dims}]")
    return total, tuple(shapes)


def _parse(hlo: str) -> tuple[str, dict[str, list[tuple[str, str, str, str]]]]:
    """``(entry name, {computation: [(name, type, opcode, rest), ...]})``."""
    computations: dict[str, list[tuple[str, str, str, str]]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = head.group(2)
            computations[current] = []
            entry = current if head.group(1) else entry
            continue
        inst = _INSTRUCTION.match(line)
        if inst and current is not None:
            computations[current].append(inst.group(2, 3, 4, 5))
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return entry, computations


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a compiled program, found by :func:`instructions`.

    ``shapes`` are its result's arrays (``"f32[1024,1024]"``) and ``bytes``
    their size; ``context`` the loops and conditional branches around it
    (``"conditional NAME[i]"`` for branch ``i``; a ``lax.cond``'s false branch
    is 0); ``fused_in`` the fusion it belongs to, if any; ``executions`` as
    for :class:`AllReduce`.
    """

    name: str
    opcode: str
    bytes: int
    shapes: tuple[str, ...]
    context: tuple[str, ...]
    executions: tuple[int, int]
    fused_in: str | None = None
    flops: int = 0


def _walk(computations, name, context, low, high, fusion=None) -> Iterator[Instruction]:
    types = {inst: type_text for inst, type_text, _, _ in computations.get(name, [])}
    for inst, type_text, opcode, rest in computations.get(name, []):
        size, shapes = _array_bytes(type_text)
        flops = _dot_flops(type_text, rest, types) if opcode == "dot" else 0
        yield Instruction(inst, opcode, size, shapes, context, (low, high), fusion, flops)
        if opcode == "while":
            callees = dict(_CALLEE.findall(rest))
            trip = _TRIP.search(rest)
            n = int(trip.group(1)) if trip else _counted_trips(computations, name, callees, rest)
            label = f"while {inst} x{n if n is not None else '?'}"
            # An unknown trip count is reported as -1 executions.
            lo, hi = (low * n, high * n) if n is not None else (-1, -1)
            yield from _walk(computations, callees["body"], (*context, label), lo, hi)
            continue
        branches = _BRANCHES.search(rest)
        names = [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else []
        names += [
            c for k, c in _CALLEE.findall(rest) if k in ("true_computation", "false_computation")
        ]
        if opcode == "conditional":
            for i, branch in enumerate(names):
                yield from _walk(
                    computations, branch, (*context, f"conditional {inst}[{i}]"), 0, high
                )
            continue
        for key, callee in _CALLEE.findall(rest):
            if key in ("calls", "to_apply") and opcode in _CALLERS:
                inner = inst if opcode in ("fusion", "fusion-start") else fusion
                yield from _walk(computations, callee, context, low, high, inner)


def _counted_trips(computations, parent: str, callees: dict[str, str], rest: str) -> int | None:
    """A loop's trip count where XLA no longer records it (its collective pipeliner peels
    iterations off a loop and drops the record): ``bound - start`` for a condition
    ``counter < bound`` whose counter, element 0 of the loop's state, starts at a constant.
    None where the loop is not of that form."""
    condition = callees.get("condition")
    compared = [condition] + [
        c for _, _, _, r in computations.get(condition, []) for _, c in _CALLEE.findall(r)
    ]
    code = [i for c in compared for i in computations.get(c, [])]
    bounds = [_constant(r) for _, t, op, r in code if op == "constant" and t.startswith("s32[]")]
    if len(bounds) != 1 or not any(op == "compare" and "direction=LT" in r for *_, op, r in code):
        return None
    parent_code = {n: (op, r) for n, _, op, r in computations.get(parent, [])}
    state = _OPERAND.match(rest)
    op, operands = parent_code.get(state.group(1) if state else "", ("", ""))
    first = _OPERAND.match(operands) if op == "tuple" else None
    op, value = parent_code.get(first.group(1) if first else "", ("", ""))
    while op in ("copy", "bitcast"):  # the start, copied into the loop's state
        source = _OPERAND.match(value)
        op, value = parent_code.get(source.group(1) if source else "", ("", ""))
    start = _constant(value) if op == "constant" else None
    if bounds[0] is None or start is None:
        return None
    return max(bounds[0] - start, 0)


def _constant(rest: str) -> int | None:
    found = re.match(r"\s*(-?\d+)\)", rest)
    return int(found.group(1)) if found else None


def _dot_flops(type_text: str, rest: str, types: dict[str, str]) -> int:
    """2 x the multiply-adds of a dot: its result's elements times the product of the
    left operand's contracting dimensions (read from the operand's own type)."""
    operand = _OPERAND.match(rest)
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
    lhs = _ARRAY.search(types.get(operand.group(1), "")) if operand else None
    out = _ARRAY.search(type_text)
    if not (contracting and lhs and out):
        return 0
    dims = [int(d) for d in filter(None, lhs.group(2).split(","))]
    k = math.prod(dims[int(i)] for i in filter(None, contracting.group(1).split(",")))
    return 2 * k * math.prod(int(d) for d in filter(None, out.group(2).split(",")))


def instructions(compiled_or_hlo: Any) -> list[Instruction]:
    """Every instruction of a compiled program, those inside fusions, loop bodies and
    conditional branches included, with where it sits and how often it runs.

    Accepts what :func:`all_reduces` accepts.
    """
    hlo = compiled_or_hlo if isinstance(compiled_or_hlo, str) else compiled_or_hlo.as_text()
    entry, computations = _parse(hlo)
    return list(_walk(computations, entry, (), 1, 1))


def all_reduces(compiled_or_hlo: Any) -> list[AllReduce]:
    """Every all-reduce of a compiled program, with bytes and executions per call.

    Accepts ``jitted.lower(*args).compile()`` (for a jaxdp step:
    ``step.compile(state, batch)``) or its ``as_text()``.
    """
    return [
        AllReduce(i.name, i.bytes, i.shapes, i.context, i.executions)
        for i in instructions(compiled_or_hlo)
        if i.opcode in ("all-reduce", "all-reduce-start")
    ]


@dataclasses.dataclass(frozen=True)
class Collective(_Placed):
    """One collective instruction of a compiled program (:func:`collectives`).

    ``kind`` is ``"all-reduce"``, ``"reduce-scatter"`` or ``"all-gather"``.
    ``bytes`` is the whole buffer of one execution, the same measure for every
    kind: what an all-reduce sums, what a reduce-scatter sums before each device
    keeps its ``1/devices`` share, what an all-gather returns to every device.
    ``devices`` is the size of its replica group; ``ring_bytes`` what each device
    sends under a ring algorithm (an all-reduce ``2 (n-1)/n`` of ``bytes``, the
    other two ``(n-1)/n``). ``context`` and ``executions`` as for :class:`AllReduce`.
    ``groups``: its replica groups, each the devices' ids (sorted), as the program lists
    them (empty where it names none).
    """

    kind: str
    name: str
    bytes: int
    devices: int
    shapes: tuple[str, ...]
    context: tuple[str, ...]
    executions: tuple[int, int]
    asynchronous: bool = False
    products_under: tuple[str, ...] = ()
    groups: frozenset[tuple[int, ...]] = frozenset()

    @property
    def ring_bytes(self) -> float:
        n = self.devices
        share = (n - 1) / n if n else 0.0
        return (2 if self.kind == "all-reduce" else 1) * share * self.bytes

    @property
    def overlapped(self) -> bool:
        """Matrix products are scheduled while it is in flight (``products_under``)."""
        return bool(self.products_under)


_LISTED = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_DEVICE_IDS = re.compile(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)")


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """XLA's iota device list ``[dims]T(perm)``: the ids in order, reshaped, transposed."""
    ids = np.arange(math.prod(int(d) for d in dims.split(","))).reshape(
        [int(d) for d in dims.split(",")]
    )
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _groups(rest: str) -> frozenset[tuple[int, ...]]:
    """The replica groups of an instruction's text, in each of XLA's spellings: listed
    (``{{0,2},{1,3}}``), iota (``[2,2]<=[4]``, ``[2,2]<=[2,2]T(1,0)``) or jax 0.12's mesh
    (``mesh['data'=2,'model'=2] {'data'}``, its devices in order or ``device_ids=``)."""
    mesh = _MESH_GROUPS.search(rest)
    if mesh:
        axes = [(a, int(n)) for a, n in _MESH_AXIS.findall(mesh.group(1))]
        spanned = set(re.findall(r"'([^']+)'", mesh.group(2)))
        ids = np.arange(math.prod(n for _, n in axes))
        given = _DEVICE_IDS.search(rest)
        if given:
            ids = _iota(given.group(1), given.group(2)).reshape(-1)
        ids = ids.reshape([n for _, n in axes])
        at = [k for k, (a, _) in enumerate(axes) if a in spanned]
        size = math.prod(ids.shape[k] for k in at)
        rows = np.moveaxis(ids, at, list(range(ids.ndim - len(at), ids.ndim))).reshape(-1, size)
    elif listed := _LISTED.search(rest):
        rows = [
            [int(d) for d in g.split(",") if d]
            for g in re.findall(r"\{([\d,]*)\}", listed.group(1))
        ]
    elif iota := _IOTA.search(rest):
        rows = _iota(iota.group(3), iota.group(4)).reshape(int(iota.group(1)), int(iota.group(2)))
    else:
        return frozenset()
    rows = rows.tolist() if isinstance(rows, np.ndarray) else rows
    return frozenset(tuple(sorted(int(d) for d in r)) for r in rows)


def collectives(compiled_or_hlo: Any) -> list[Collective]:
    """Every all-reduce, reduce-scatter and all-gather of a compiled program, with
    the bytes of its whole buffer, its executions per call and what runs under it.

    Accepts what :func:`all_reduces` accepts. For a jaxdp step at ZeRO stage 1:
    reduce-scatters and one all-gather of the split leaves' gradient and parameter
    bytes (their ring bytes add up to one all-reduce's), and one small all-reduce of
    the leaves kept whole with the norm's, loss and weight sums.

    An asynchronous collective (XLA:GPU's start and done) lists in
    ``products_under`` the matrix products scheduled between its start and its done:
    dots and convolutions, XLA:GPU's GEMM library calls, and the fusions, calls and
    loops that hold one (by name, in schedule order). That is the compute it hides
    behind: a gradient all-reduce with backward GEMMs under it costs no time of its
    own if they take longer than it does.
    """
    hlo = compiled_or_hlo if isinstance(compiled_or_hlo, str) else compiled_or_hlo.as_text()
    entry, computations = _parse(hlo)
    rests = {name: rest for insts in computations.values() for name, _, _, rest in insts}
    windows = _async_windows(computations)
    found = []
    for i in _walk(computations, entry, (), 1, 1):
        kind = _KINDS.get(i.opcode)
        if kind is None:
            continue
        size, shapes, under = i.bytes, i.shapes, ()
        started = i.name if i.name in windows else i.fused_in
        if i.name in windows:  # a start: the done's result is the collective's
            (size, shapes), under = windows[i.name]
        elif started in windows:  # in a collective fusion: in flight until its done
            under = windows[started][1]
        groups = _groups(rests.get(i.name, ""))
        devices = len(next(iter(groups))) if groups else 1
        size = size * devices if kind == "reduce-scatter" else size
        found.append(
            Collective(
                kind,
                i.name,
                size,
                devices,
                shapes,
                i.context,
                i.executions,
                asynchronous=started in windows,
                products_under=under,
                groups=groups,
            )
        )
    return found


def _async_windows(computations) -> dict[str, tuple[tuple[int, tuple[str, ...]], tuple[str, ...]]]:
    """``start name -> ((bytes, shapes) of its done, products scheduled in between)``
    for every asynchronous collective of the program."""
    products = _product_holders(computations)
    windows = {}
    for insts in computations.values():
        position = {name: k for k, (name, *_) in enumerate(insts)}
        for k, (_, type_text, opcode, rest) in enumerate(insts):
            if not opcode.endswith("-done"):
                continue
            start = _OPERAND.match(rest)
            if start is None or start.group(1) not in position:
                continue
            begin = position[start.group(1)]
            under = tuple(n for n, *_ in insts[begin + 1 : k] if n in products)
            windows[start.group(1)] = (_array_bytes(type_text), under)
    return windows


def _product_holders(computations) -> set[str]:
    """Names of the instructions that are, or run, a matrix product: a dot or
    convolution, a GEMM library call, or a fusion, call, loop or conditional whose
    computations hold one."""
    holds: dict[str, bool] = {}

    def computes(computation: str) -> bool:
        if computation not in holds:
            holds[computation] = False  # a cycle never counts
            holds[computation] = any(
                _is_product(opcode, rest, computes)
                for _, _, opcode, rest in computations.get(computation, [])
            )
        return holds[computation]

    return {
        name
        for insts in computations.values()
        for name, _, opcode, rest in insts
        if _is_product(opcode, rest, computes)
    }


def _is_product(opcode: str, rest: str, computes) -> bool:
    if opcode in _PRODUCTS or (opcode == "custom-call" and _PRODUCT_CALL.search(rest)):
        return True
    called = [c for _, c in _CALLEE.findall(rest)]
    branches = _BRANCHES.search(rest)
    if branches:
        called += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
    return opcode in ("fusion", "call", "while", "conditional", "async-start") and any(
        computes(c) for c in called
    )


def format_report(reduces: list[AllReduce] | list[Collective]) -> str:
    """A readable table of :func:`all_reduces` or :func:`collectives`; for collectives
    XLA runs asynchronously, the number of matrix products scheduled under each."""
    lines = [f"{'all-reduce':<28} {'bytes':>12} {'runs/call':>10}  where"]
    overlap = any(isinstance(r, Collective) and r.asynchronous for r in reduces)
    if any(isinstance(r, Collective) for r in reduces):
        under = f" {'products under':>14}" if overlap else ""
        lines = [f"{'collective':<28} {'kind':<15} {'bytes':>12} {'runs/call':>10}{under}  where"]
    for r in reduces:
        lo, hi = r.executions
        runs = str(hi) if lo == hi else f"{lo}..{hi}"
        kind = f" {r.kind:<15}" if isinstance(r, Collective) else ""
        under = ""
        if overlap:
            count = str(len(r.products_under)) if r.asynchronous else "synchronous"
            under = f" {count:>14}"
        where = " > ".join(r.context) or "top level"
        lines.append(f"{r.name:<28}{kind} {r.bytes:>12,} {runs:>10}{under}  {where}")
    return "\n".join(lines)

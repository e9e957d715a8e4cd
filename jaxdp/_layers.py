"""ZeRO stage 3 inside the step: the split parameters gathered for ``loss_fn``, and
:func:`scan_layers`, the loop over a stack of layers that gathers one layer at a time.

At stage 3 each device holds its block of every split parameter (:mod:`._shards`). The
step hands ``loss_fn`` the parameters outside every stack of layers gathered whole (ONE
packed all-gather per dtype per micro-batch) and the stacked ones as blocks, which
:func:`scan_layers` gathers a layer at a time inside its loop, under a remat that saves
no gathered weight: the peak holds one layer's weights, not the model's. Every gather
is :func:`gather`, whose backward is the packed reduce-scatter of stage 2: each
device gets its block of the gradient's global sum (in ``comm_dtype`` on the wire). A
leaf the state holds padded (no dimension of it divides) is gathered padded and sliced
to its own shape, a stack's layer by layer, so ``loss_fn`` never sees the padding; its
gradient is padded with zeros again before the reduce-scatter.

Which leaves are a stack is data, not a guess: the step's :class:`jaxdp._shards.ShardPlan`
reads it from ``Parallel.layers`` or the model's own "layers" sharding metadata, and hands
each declared stack to ``loss_fn`` as a :class:`Stack`, its blocks and their split
dimension with it, which :func:`scan_layers` alone takes (any other use is refused naming
the leaf). ``loss_fn`` is traced once, as at stage 0. With no stack declared every split
leaf is gathered whole up front, with a warning (docs/decisions.md, "ZeRO stage 3").
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from ._mesh import psum
from ._shards import (
    compress,
    decompress,
    on_model_shards,
    packed_all_gather,
    packed_psum,
    packed_reduce_scatter,
)

Carry = TypeVar("Carry")


@dataclasses.dataclass(frozen=True)
class Gather:
    """How the split leaves travel and what the layer loop keeps: the shard axis, its size
    (a shard group's), the reduce-scatter's wire dtype (None: the gradients' own), the
    gather's (None: the parameters' own; ``Parallel.gather_dtype``), the remat policy of
    :func:`scan_layers`' loop (``Parallel.remat``), and whether the leaves outside the
    stacks travel packed into one collective per dtype (XLA:CPU) or one per leaf, for
    XLA to combine and schedule each where it is used; the model axes
    (``Parallel.model_axes``), over which each device gathers its own shards."""

    axis_name: str
    num_devices: int
    wire: Any = None
    dtype: Any = None
    remat: Any = "dots"
    packed: bool = True
    model_axes: tuple[str, ...] = ()  # the mesh's axes the model's own shardings use

    @property
    def policy(self) -> Callable[..., bool]:
        """The ``jax.checkpoint`` policy of ``remat``."""
        if callable(self.remat):
            return self.remat
        policies = jax.checkpoint_policies
        return policies.dots_saveable if self.remat == "dots" else policies.nothing_saveable


def scan_layers(fn: Callable[[Any, Carry], Carry], layers: Any, carry: Carry) -> Carry:
    """``fn(layer, carry) -> carry`` over the leading (layer) axis of ``layers``.

    ``layers``: a pytree of arrays that share a leading axis of L layers (Linen's
    ``nn.scan`` parameters, a stacked pytree), or an NNX module built with ``nnx.vmap``
    (split, scanned over its state and merged for each layer, as flax's GSPMD guide
    does; variables ``fn`` writes are not carried out of the loop). ``fn`` gets one
    layer (the leaves indexed at the layer) and the carry, and returns the carry in
    the same structure, shapes and dtypes.

    Outside a step, and at ZeRO stages 0 to 2 without a declared stack, a plain
    ``jax.lax.scan``. Inside a step the stacks declared (``Parallel.layers``, or the
    model's "layers" sharding metadata) come as the step's blocks, their split
    dimension with them: at ``Parallel(zero_stage=3)`` every split leaf of a layer is
    gathered in ONE collective inside the loop body, under ``jax.checkpoint`` with
    ``Parallel.remat``'s policy (on any device count, also where nothing is split): the
    backward gathers each layer again instead of keeping the gathered weights, so the
    step's peak holds one layer at a time; each layer's gradient is reduce-scattered
    inside the loop (docs/semantics.md, "ZeRO stage 3"), and under HSDP its block
    all-reduced across the replica groups in the backward of the layer below (the
    lowest layer's after the loop; the top layer runs outside the loop there, and XLA
    keeps its gathered weights for its backward, which follows at once). At stages 0 to
    2 on GPUs each layer's gradient leaves the backward as that layer's ends
    (:class:`Stack`).

    Raises:
      ValueError: ``layers`` has no array leaf, a scalar leaf, or leaves of different
        leading lengths (naming two of them); an NNX module of one layer's flax layers
        (``nnx.Linear``, ``nnx.Sequential`` of them: not stacked with ``nnx.vmap``).
    """
    graphdef, state = (None, layers)
    if isinstance(layers, nnx.Module):
        _check_a_stack(layers)
        graphdef, state = nnx.split(layers)
    leaves, treedef = jax.tree.flatten(state)
    stacks = [x if isinstance(x, Stack) else None for x in leaves]
    declared = next((x for x in stacks if x is not None), None)  # Parallel.layers
    if declared is not None and declared.route.kind != "gather":
        return _scan_routed(fn, graphdef, treedef, leaves, stacks, carry)
    dims, sizes, models, how, across = [None] * len(leaves), None, None, None, None
    if declared is not None:  # stage 3: the blocks handed over, gathered here
        leaves = [x if s is None else s.value for x, s in zip(leaves, stacks, strict=True)]
        dims, how = [None if s is None else s.dim for s in stacks], declared.route.gather
        sizes = [None if s is None else s.size for s in stacks]
        models = [() if s is None else s.model for s in stacks]
        across = next((s.route.across for s in stacks if s is not None and s.route.across), None)
    _check_layers(treedef.unflatten(leaves))

    def body(carry, xs):
        if how is not None:
            xs = gather(xs, dims, how, sizes, models)
        layer = treedef.unflatten(xs)
        if graphdef is not None:
            layer = nnx.merge(graphdef, layer)
        return fn(layer, carry), None

    if how is not None:
        # No gathered weight saved (no policy saves an all-gather's result): the backward
        # gathers the layer again, so the peak holds one layer's weights. What else the
        # backward keeps is Parallel.remat's. At every stage-3 step, also where no leaf
        # is split (one device, leaves kept whole): the step's temporaries keep one shape,
        # the closed form of docs/scaling-out.md; without it a 1-device GPT-2 step held
        # 5.6x the temporaries (BENCHMARKS.md, "The layer loop's price on a GPU").
        # prevent_cse=False: the loop already keeps XLA from merging the backward's
        # gather with the forward's (JAX's advice for remat inside scan), and the barrier
        # it would add keeps XLA's collective pipeliner from moving the backward's
        # gather one layer ahead.
        body = jax.checkpoint(body, policy=how.policy, prevent_cse=False)
    if across is not None:  # HSDP: each layer's blocks all-reduced over the replicas too
        return _scan_relayed(body, across, leaves, stacks, carry)
    return jax.lax.scan(body, carry, leaves)[0]


def _scan_relayed(body, route: Route, leaves, stacks, carry):
    """HSDP's loop over a stack: ``body`` a layer at a time, and in the backward each
    layer's reduce-scattered blocks all-reduced over the replica groups by ``route``
    (plus the window's sums of them) ONE LAYER LATER, in the backward of the layer below,
    under that layer's matrix products, and written into the sinks one layer later again;
    the lowest layer's all-reduce, the backward's last, after the loop. The blocks and the
    all-reduced blocks go down through a mailbox the loop carries (:func:`_relayed`).

    Why written here: in the layer's own backward the all-reduce waits for that layer's
    reduce-scatter, the last thing it does, and XLA's collective pipeliner, which moved it
    on a layer, peels a layer out of the backward's loop for each kind of collective it
    moves; XLA:GPU's scheduler keeps no collective in flight across a loop's bounds, so
    the peeled layers' all-reduces were exposed. Written into the sinks in the layer it
    is reduced in, XLA began that write (an asynchronous dynamic-update-slice) as early
    as it could, and so ended the all-reduce after two products. GPT-2 small scanned,
    ``shards=8`` on 2 x 8 to 128 x 8 H100s: 82.5% of these all-reduces' bytes but the
    embeddings' under a matrix product -> 90.8%, at K=1 and 4 (BENCHMARKS.md, section 9).
    The top layer runs outside the loop (the backward's first, nothing comes from above),
    so XLA keeps its gathered weights for its backward, which follows at once: one
    layer's gather fewer."""
    which = [i for i, s in enumerate(stacks) if s is not None and s.sink is not None]
    # The split ones (a stack kept whole has no block to send: it is not routed). Their
    # gradients leave through the sinks, as the mailbox hands them on.
    leaves = [jax.lax.stop_gradient(x) if i in which else x for i, x in enumerate(leaves)]
    sums = tuple(stacks[i].sums for i in which)
    sinks = tuple(stacks[i].sink for i in which)
    n, dims = jnp.shape(leaves[which[0]])[0], (None,) * len(which)
    models = tuple(stacks[i].model for i in which)

    def rows(tree, start, stop=None):
        return jax.tree.map(lambda x: x[start:stop], tree)

    def relayed(at, values, mail, sums, write):
        picked = None if values is None else tuple(values[i] for i in which)
        picked, mail = _relayed(at, route, dims, models, picked, mail, sums, write)
        if values is not None:
            values = list(values)
            for i, x in zip(which, picked, strict=True):
                values[i] = x
        return values, mail

    def below_the_top(state, xs):
        carry, mail = state
        values, sums_above, write = xs
        values, mail = relayed("layer", values, mail, sums_above, write)
        return (body(carry, values)[0], mail), None

    # The mailbox: a layer's blocks on their way to the all-reduce (zeros in the forward)
    # and the all-reduced blocks from two layers above on their way to their sinks' row. It
    # starts at the lowest layer's row, which gets what arrives there last: that layer's.
    mail = (tuple(jnp.zeros_like(leaves[i][0]) for i in which), tuple(x[0] for x in sinks))
    lowest = tuple(None if x is None else x[0] for x in sums)
    second = tuple(x[1] for x in sinks) if n > 1 else None
    _, mail = relayed("bottom", None, mail, lowest, second)
    if n > 1:
        # Layer j writes the row of layer j + 2; the one below the top, a zero row.
        writes = jax.tree.map(lambda x: jnp.concatenate([x[2:], jnp.zeros_like(x[:1])]), sinks)
        xs = (rows(leaves, 0, n - 1), rows(sums, 1), writes)
        carry, mail = jax.lax.scan(below_the_top, (carry, mail), xs)[0]
    top, _ = relayed("top", [x[n - 1] for x in leaves], mail, None, None)
    return body(carry, top)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _relayed(at: str, route: Route, dims: tuple[Any, ...], models, values, mail, sums, write):
    """``(values, mail)``: a layer's blocks and the mailbox (``(blocks, reduced)``) of
    :func:`_scan_relayed`'s loop. In the backward the blocks' gradients go into the
    mailbox, to the layer below; the blocks that arrive in it (the layer above's), plus
    the window's ``sums`` of them, are all-reduced by ``route`` and go on in it; the
    all-reduced blocks that arrive (from two layers above) are the gradient of ``write``,
    that layer's row of the sinks. ``at``: ``"layer"``; ``"top"``, which only hands its
    blocks down; ``"bottom"``, no layer, the mailbox's start: what arrives, the lowest
    layer's, is all-reduced into the mailbox's own row; ``write`` is None only there, at
    the bottom of a one-layer stack."""
    return values, mail


def _relayed_forward(at, route, dims, models, values, mail, sums, write):
    like = tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in mail[1])
    return (values, mail), (sums, like, write is not None)


def _relayed_backward(at, route, dims, models, residuals, cotangents):
    sums, like, writes = residuals
    grads, (arrived, reduced_above) = cotangents
    handed = None
    if at != "bottom":
        handed = tuple(g.astype(m.dtype) for g, m in zip(grads, arrived, strict=True))
    if at == "top":
        return None, (handed, None), None, None
    # One collective for the layer: combined with another, its bucket waited for that
    # one's (the embeddings', after the loop); XLA's combiner leaves it whole.
    packed = dataclasses.replace(route, packed=True)
    reduced = _routed_backward(packed, dims, models, (sums, like), arrived)[2]
    if handed is not None:
        # Tied to the blocks handed down: the layer below's all-reduce begins after this
        # one, so XLA cannot combine the two into one that waits for the lower layer's
        # reduce-scatter (without it 8.3% of the bytes were hidden, not 90.8%).
        handed = jax.lax.optimization_barrier((handed, reduced))[0]
    return None, (handed, reduced), None, reduced_above if writes else None


_relayed.defvjp(_relayed_forward, _relayed_backward)


def _check_a_stack(layers: nnx.Module) -> None:
    """Refuses an NNX module that holds flax layers of one layer's shape (one layer, an
    ``nnx.Sequential`` of them): their leading axis is a weight's, not layers', and the loop
    failed inside JAX ("Incompatible shapes for broadcasting") on slices of them."""
    for path, module in nnx.iter_modules(layers):
        if isinstance(module, nnx.Linear | nnx.Embed):
            name, rank = ("kernel", 2) if isinstance(module, nnx.Linear) else ("embedding", 2)
        elif isinstance(module, nnx.Conv):
            size = module.kernel_size
            name, rank = "kernel", 2 + (1 if isinstance(size, int) else len(size))
        elif isinstance(module, nnx.LayerNorm | nnx.RMSNorm) and module.scale is not None:
            name, rank = "scale", 1
        else:
            continue
        shape = jnp.shape(getattr(module, name).get_value())
        if len(shape) == rank:  # a stack of them has one more, leading axis
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
            got = f"{_name(layers)}, whose layers{where} is " if path else ""
            raise ValueError(
                "scan_layers: layers must be a stack of layers on a leading (layer) axis, "
                "one module built with nnx.vmap (or a pytree of stacked leaves); got "
                f"{got}one {_name(module)} ({name} of shape {shape}: one layer's, no "
                "layer axis)"
            )


def _name(module: nnx.Module) -> str:
    kind = type(module)
    return f"nnx.{kind.__name__}" if kind.__module__.startswith("flax.nnx") else kind.__name__


def _check_layers(state: Any) -> None:
    named = jax.tree_util.tree_flatten_with_path(state)[0]
    if not named:
        raise ValueError("scan_layers: layers has no array leaf to loop over")
    for path, x in named:
        if jnp.ndim(x) == 0:
            raise ValueError(
                f"scan_layers: layers{jax.tree_util.keystr(path)} is a scalar; every leaf "
                "needs the leading layer axis (stack the layers' leaves, or build the "
                "module with nnx.vmap)"
            )
    (first, x0), *rest = named
    for path, x in rest:
        if jnp.shape(x)[0] != jnp.shape(x0)[0]:
            raise ValueError(
                "scan_layers: every leaf of layers needs the same leading (layer) axis: "
                f"layers{jax.tree_util.keystr(first)} has {jnp.shape(x0)[0]} layers "
                f"(shape {jnp.shape(x0)}), layers{jax.tree_util.keystr(path)} has "
                f"{jnp.shape(x)[0]} (shape {jnp.shape(x)})"
            )


# ---- stages 0 to 2: a stack's gradients leave the loop's backward layer by layer ----------


@dataclasses.dataclass(frozen=True)
class Route:
    """How the gradients of a stack's layers leave :func:`scan_layers`' backward at ZeRO
    stages 0 to 2 on a GPU mesh: ``"psum"`` (stage 0) all-reduces each layer's gradient
    (plus the window's sums of it) over ``axes``; ``"scatter"`` (stages 1 and 2)
    reduces-scatters it over ``axes`` along each leaf's split dimension; ``"gather"``
    (stage 3) gathers each layer's blocks in the loop (``gather``), whose backward
    reduce-scatters them. ``n``: the devices it runs over; ``wire``:
    ``Parallel.comm_dtype`` (None: the sums' own). ``across`` (HSDP, stage 3): the
    ``"psum"`` route over the replica groups that each layer's reduce-scattered block
    (plus the window's sums of it) takes next, in the same backward, a layer later
    (:func:`_scan_relayed`). ``packed``: a layer's gradients travel in one collective
    per dtype (stages 0 to 2, and a stack's blocks across the replica groups), not one
    per leaf for XLA to combine into buckets (HSDP's other blocks).

    Why packed at stages 0 to 2: XLA's combiner otherwise merges leaves of neighbouring
    layers into one bucket, which waits for its last leaf, so the buckets of the first
    layers (the backward's last) had no matrix product left under them. Measured on the
    scanned GPT-2 small for 8 H100s (BENCHMARKS.md section 9, "The scanned model"):
    stage 0 84.9% -> 100% of the bytes but the embeddings' hidden, stage 2 79.4% -> 100%.
    A stack's blocks across the replica groups are packed where they are sent
    (:func:`_relayed`): ``packed`` is False for HSDP's leaves outside every stack."""

    kind: str
    axes: Any
    n: int
    wire: Any = None
    gather: Any = None  # "gather" (stage 3): the blocks' Gather, gathered in the loop
    across: Route | None = None
    packed: bool = False
    model_axes: tuple[str, ...] = ()  # Parallel.model_axes: each device sends its shards


@dataclasses.dataclass(frozen=True, eq=False)
class Stack:
    """A parameter leaf that is a stack of layers (``Parallel.layers``), as the step
    hands it to ``loss_fn`` at ZeRO stages 0 to 2 on a GPU mesh: for
    :func:`scan_layers` only, which loops over ``value`` and sends each layer's
    gradient as that layer's backward ends (DDP's buckets, one layer at a time),
    adding ``sums`` (the window's sums of this leaf's gradient, on the window's last
    micro-batch; None: none to add) first. The gradient comes out as the step's
    ``sink``'s (the reduced shape: a block at stages 1 and 2).

    Anything else ``loss_fn`` does with it is refused naming the leaf (``astype``,
    elementwise, is taken: it casts the layers it hands over)."""

    value: jax.Array
    sums: jax.Array | None
    sink: jax.Array
    dim: int | None  # a layer's split dimension (the stack's minus one); None: psum
    route: Route
    name: str
    size: int | None = None  # stage 3: a padded leaf's logical size along dim (None: not)
    model: tuple[Any, ...] = ()  # stage 3: a layer's split over the model axes (model_specs)

    shape = property(lambda self: self.value.shape)
    dtype = property(lambda self: self.value.dtype)
    ndim = property(lambda self: self.value.ndim)

    def astype(self, dtype: Any) -> Stack:
        return dataclasses.replace(self, value=self.value.astype(dtype))

    def _refused(self, *_: Any) -> Any:
        raise TypeError(_ROUTED_ELSEWHERE.format(name=self.name))

    __jax_array__ = __getitem__ = __array__ = __iter__ = __len__ = __neg__ = __pos__ = _refused
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refused
    __matmul__ = __rmatmul__ = __truediv__ = __rtruediv__ = __pow__ = _refused

    def __repr__(self) -> str:
        return f"Stack({self.name}, shape={self.shape}, dtype={self.dtype})"


_ROUTED_ELSEWHERE = (
    "params{name} is a stack of layers (Parallel.layers), which the step hands to "
    "jaxdp.scan_layers alone, so that each layer's gradient is sent as its backward ends; "
    "loss_fn uses it otherwise (as an array, or in a transform other than astype): pass "
    "it to jaxdp.scan_layers(fn, layers, carry) untransformed, or leave it out of "
    "Parallel.layers"
)


def _scan_routed(fn, graphdef, treedef, leaves, stacks, carry):
    """:func:`scan_layers` over layers some of whose leaves are the step's :class:`Stack`:
    each layer's gradient reduced as that layer's backward ends, in a loop unrolled.

    Unrolled: XLA:GPU (jaxlib 0.12) ran no collective inside a loop's body under that
    body's matrix products, in any spelling tried (reduced in the layer's own backward,
    one layer later through a mailbox the loop carries, with its collective pipeliner
    on, or with more collectives in flight): at stages 0 to 2 GPT-2 small's stack on 8
    H100s hid 1-7% of its bytes (HSDP's cross-replica all-reduce at stage 3, behind a
    reduce-scatter and a gather in each layer, does hide so: :func:`_scan_relayed`).
    The unrolled backward is one region, where each layer's reduction runs under the
    layers' before it, as a Python loop's does. At stages 0 to 2 the loop saves compile
    time only (nothing is gathered, no remat), which this costs."""
    route = next(s.route for s in stacks if s is not None)
    which = [i for i, s in enumerate(stacks) if s is not None]
    values = [
        jax.lax.stop_gradient(s.value) if s is not None else x
        for x, s in zip(leaves, stacks, strict=True)
    ]
    _check_layers(treedef.unflatten(values))
    sums = tuple(stacks[i].sums for i in which)
    sinks = tuple(stacks[i].sink for i in which)
    dims = tuple(stacks[i].dim for i in which)
    models = tuple(stacks[i].model for i in which)

    def body(carry, xs):
        layer = treedef.unflatten(_route_layer(route, dims, models, which, *xs))
        if graphdef is not None:
            layer = nnx.merge(graphdef, layer)
        return fn(layer, carry), None

    return jax.lax.scan(body, carry, (values, sums, sinks), unroll=True)[0]


def _route_layer(route: Route, dims, models, which: list[int], values, sums, rows) -> list[Any]:
    """One layer's ``values`` with those at ``which`` through :func:`_routed` (their
    gradients reduced by ``route`` into ``rows``, the window's ``sums`` added first)."""
    routed = _routed(route, dims, models, tuple(values[i] for i in which), sums, rows)
    values = list(values)
    for i, x in zip(which, routed, strict=True):
        values[i] = x
    return values


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _routed(route: Route, dims: tuple[Any, ...], models: tuple[Any, ...], values, sums, rows):
    """A layer's ``values``; in its backward their gradients, plus the window's ``sums``
    of them (None: none), are reduced by ``route`` into ``rows``' (the sinks' row)."""
    return values


def _routed_forward(route, dims, models, values, sums, rows):
    return values, (sums, tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in rows))


def _routed_backward(route, dims, models, residuals, cotangents):
    sums, like = residuals
    grads = [
        g.astype(k.dtype) + (0 if s is None else s.reshape(g.shape).astype(k.dtype))
        for g, s, k in zip(cotangents, sums, like, strict=True)
    ]

    def reduced(grads: list[Any]) -> list[Any]:
        if route.kind == "psum" and not route.packed:
            summed = psum([compress(g, route.wire, route.n) for g in grads], route.axes)
            return [
                decompress(x, g.dtype, route.wire, route.n)
                for x, g in zip(summed, grads, strict=True)
            ]
        if route.kind == "psum":
            return packed_psum(grads, route.axes, route.n, route.wire)
        return packed_reduce_scatter(
            grads, list(dims), route.axes, route.n, route.wire, packed=route.packed
        )

    # On each device's own model shards (a packed buffer of model-split leaves, left to
    # XLA, was gathered over the model axes first).
    summed = route.axes if route.kind == "psum" else ()
    out = on_model_shards(reduced, grads, models, route.model_axes, summed)
    return None, None, tuple(x.reshape(k.shape) for x, k in zip(out, like, strict=True))


_routed.defvjp(_routed_forward, _routed_backward)


# ---- loss_fn at stage 3 -----------------------------------------------------------------


_NOT_DECLARED = (
    "Parallel(zero_stage=3): no stack of layers is declared (Parallel.layers, or the "
    "model's 'layers' sharding metadata), so every split parameter is gathered whole for "
    "each micro-batch: they rest split (1/{n} per device) but the step's peak memory is "
    "not reduced; declare the stack and loop over it with jaxdp.scan_layers(fn, layers, "
    "carry) (docs/semantics.md, 'ZeRO stage 3')"
)


def gathered_loss(
    parts: Callable[..., Any],
    dims: list[int | None],
    how: Gather,
    warn: Callable[[str], None],
    declared: list[bool],
    sizes: list[int | None] | None = None,
    models: list[tuple[Any, ...]] | None = None,
) -> Callable[..., Any]:
    """``parts(params, *rest)`` (:func:`jaxdp._forward.loss_parts`) on the parameters
    as this device holds them at stage 3: ``dims`` per parameter leaf, the dimension
    it is split along (None: whole); ``declared`` per parameter leaf, a stack of layers
    (the plan's, from ``Parallel.layers`` or the model's metadata); ``sizes`` per
    parameter leaf, the logical size along its dimension of a leaf that rests padded
    (None: not), so that ``loss_fn`` gets every leaf in the model's shape; ``models`` per
    parameter leaf, its split over the model axes (:func:`jaxdp._shards.model_specs`;
    None: none), kept through the gather. The leaves outside
    every stack are gathered up front in one collective per dtype; each stack goes to
    ``loss_fn`` as a :class:`Stack` of its blocks, for :func:`scan_layers` alone, which
    gathers it a layer at a time (also a stack kept whole: the loop's remat is the
    step's). ``warn`` gives a warning once per step: no stack declared, split leaves."""
    # A stack split along its layer axis (a 1-D one) cannot be looped a layer at a time.
    stacked = {i for i, d in enumerate(dims) if declared[i] and (d is None or d >= 1)}
    sizes = sizes or [None] * len(dims)
    models = models or [()] * len(dims)
    route = Route("gather", how.axis_name, how.num_devices, how.wire, gather=how)

    def parts_at_stage_3(params: Any, *rest: Any) -> Any:
        leaves, treedef = jax.tree.flatten(params)
        if not stacked and any(d is not None for d in dims):
            warn(_NOT_DECLARED.format(n=how.num_devices))
        # HSDP: the split leaves come as Stack (jaxdp._pipeline.Routing), to be all-reduced
        # over the replica groups (a stack's in the backward of the layer below its own,
        # scan_layers' loop; the others whole, as they are done).
        handed = [x if isinstance(x, Stack) else None for x in leaves]
        leaves = [x if h is None else h.value for x, h in zip(leaves, handed, strict=True)]
        up_front = [None if i in stacked else d for i, d in enumerate(dims)]
        which = [i for i, d in enumerate(up_front) if d is not None]
        for i, h in enumerate(handed):
            if h is not None and i not in stacked:  # all-reduced whole, as it is done
                model = (tuple(models[i]),)
                leaves[i] = _routed(h.route, (None,), model, (leaves[i],), (h.sums,), (h.sink,))[0]
        if which:
            # Tied to this micro-batch's inputs: the parameters do not change within a
            # window, so XLA hoisted the gather out of the micro-batch loop and kept the
            # whole leaves for the window (more memory, 1/K of the gathers: a later
            # regather="window", not this default).
            blocks = [leaves[i] for i in which]
            batch = jax.tree.leaves(rest[0])  # parts(params, batch, ...)
            blocks = jax.lax.optimization_barrier((blocks, batch))[0]
            for i, x in zip(which, blocks, strict=True):
                leaves[i] = x
        leaves = gather(leaves, up_front, how, sizes, models)
        paths = jax.tree_util.tree_flatten_with_path(params)[0]
        for i in stacked:
            name, h, dim = jax.tree_util.keystr(paths[i][0]), handed[i], dims[i]
            dim = None if dim is None else dim - 1  # a layer's: its stack's minus the layer axis
            model = tuple(models[i][1:])
            if h is None:
                leaves[i] = Stack(leaves[i], None, None, dim, route, name, sizes[i], model)
            else:
                across = dataclasses.replace(route, across=h.route)
                leaves[i] = Stack(leaves[i], h.sums, h.sink, dim, across, name, sizes[i], model)
        return parts(treedef.unflatten(leaves), *rest)

    return parts_at_stage_3


# ---- the gather and its transpose ----------------------------------------------------


def gather(
    leaves: list[Any],
    dims: list[int | None],
    how: Gather,
    sizes: list[int | None] | None = None,
    models: list[tuple[Any, ...]] | None = None,
) -> list[Any]:
    """``leaves`` with each split one (``dims[i]`` not None: this device's block along
    that dimension) gathered whole: one all-gather per dtype (in ``how.dtype`` when
    set: the whole leaf in that dtype); its gradient is this device's block of the
    global sum in the block's dtype (one reduce-scatter per dtype). ``sizes[i]``: a
    padded leaf's logical size along ``dims[i]`` (None: not padded): the gathered leaf
    is sliced to it, and its gradient padded with zeros back before the reduce-scatter.
    ``models[i]``: a leaf's split over the model axes (:func:`jaxdp._shards.model_specs`;
    empty: none), which it keeps: each device gathers (and reduce-scatters) its own
    shards over the data axis (:func:`jaxdp._shards.on_model_shards`)."""
    which = [i for i, d in enumerate(dims) if d is not None]
    if not which:
        return list(leaves)
    sizes = sizes or [None] * len(dims)
    models = models or [()] * len(dims)
    blocks = tuple(leaves[i] for i in which)
    layout = (
        tuple(dims[i] for i in which),
        tuple(str(x.dtype) for x in blocks),
        tuple(sizes[i] for i in which),
        tuple(tuple(models[i]) for i in which),
    )
    whole = _gathered(layout, how, blocks)
    out = list(leaves)
    for i, x in zip(which, whole, strict=True):
        out[i] = x
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gathered(layout: tuple[Any, Any], how: Gather, blocks: tuple[Any, ...]) -> tuple[Any, ...]:
    return _gathered_forward(layout, how, blocks)[0]


def _gathered_forward(layout, how, blocks):
    dims, sizes, models = layout[0], layout[2], layout[3]

    def gathered(blocks):
        blocks = _cast(tuple(blocks), how.dtype)
        if how.packed:
            return packed_all_gather(blocks, dims, how.axis_name, how.num_devices, sizes)
        # One each: XLA combines them and schedules each where it is used.
        return [
            packed_all_gather([x], [d], how.axis_name, how.num_devices, [s])[0]
            for x, d, s in zip(blocks, dims, sizes, strict=True)
        ]

    return tuple(on_model_shards(gathered, blocks, models, how.model_axes)), None


def _gathered_backward(layout, how, _, cotangents):
    # The gradients go back in the blocks' dtypes (the gather dtype is the forward's); a
    # padded leaf's logical gradient is padded with zeros by the reduce-scatter.
    dims, dtypes, _, models = layout

    def scattered(cotangents):
        return packed_reduce_scatter(
            _cast(tuple(cotangents), dtypes),
            dims,
            how.axis_name,
            how.num_devices,
            how.wire,
            packed=how.packed,
        )

    return (tuple(on_model_shards(scattered, cotangents, models, how.model_axes)),)


def _cast(xs: tuple[Any, ...], dtype: Any) -> tuple[Any, ...]:
    """``xs`` in ``dtype`` (one, or one per leaf; None: as they are)."""
    if dtype is None:
        return xs
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,) * len(xs)
    return tuple(x.astype(t) for x, t in zip(xs, dtypes, strict=True))


_gathered.defvjp(_gathered_forward, _gathered_backward)

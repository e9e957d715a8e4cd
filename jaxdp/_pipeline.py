"""One call of the data-parallel step, read top to bottom: what ``TrainStep.__call__``
runs under ``jax.jit`` (the host side, before and after, is in :mod:`._step`).

Every call, on either path and at every ZeRO stage, runs four stages in this order:

1. accumulate (:func:`accumulate`, per device): each micro-batch's gradient, loss and
   weight added into a :class:`Window`'s sums, in the accumulator dtype (at ZeRO stage 3
   the forward first gathers the split parameters, :mod:`jaxdp._layers`; with
   ``regather="window"`` they are gathered once, before the fused path's loop);
2. reduce (:func:`reduce`, per device): the window's sums made global, the step's only
   gradient collective (a psum; at ZeRO stages a reduce-scatter and a small psum;
   under HSDP first one all-reduce of the blocks across the replica groups), issued per
   leaf: XLA combines the leaves into buckets of ``Parallel.bucket_cap_mb`` and, on
   GPUs, schedules each under the rest of the last micro-batch's backward;
3. update (:func:`update`): the user's ``optimizer.update`` on the mean gradients, or
   the skip of a non-finite update, on the logical arrays;
4. end (:func:`end`): the new state laid out as the step keeps it, and the metrics.

``fused`` runs 1 and 2 in one mesh map (1 as a ``lax.scan`` over the call's
micro-batches but the last, then the last, so that its backward and 2 are one region of
the program), then 3 and 4. ``multisteps`` is the same pipeline cut into calls: every
call runs 1 for its micro-batch into ``state.window``, and the window's last call runs
1, 2 and 3 in one ``lax.cond`` branch that the other calls skip, and restarts the window.

Lines spelled for XLA:CPU are marked ``XLA:CPU spelling`` beside the line whose
meaning they tune, with their measurement: only a CPU mesh takes them
(``StepOptions.cpu_spelling``); every other backend runs the plain spelling, which
means the same (``jaxdp.testing.plain_spelling`` runs it on a CPU mesh).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._forward import check_aux, loss_parts, micro_forward
from ._frozen import combine, split_trainable, trainable_mask
from ._guards import check_params_layout, check_state_layout, check_window_layout
from ._layers import Gather, Route, Stack, gather, gathered_loss
from ._mesh import mark_varying, psum
from ._mesh_map import is_spec, mesh_map, to_varying
from ._model_kinds import linen_batch_norms
from ._model_state import configure, device0, from_wire, split_state
from ._options import StepOptions
from ._shards import ShardPlan, compress, decompress, merged, model_specs, spec
from ._train_state import LogicalShapes, Report, SkipCounts, TrainState, Window

Forward = Callable[..., tuple[Any, jax.Array, jax.Array, Any, Any]]
"""``forward(trainable, micro_batch, batch_stats, micro_index, scale) -> (grads, value,
weight, new_batch_stats, aux)`` of one micro-batch on one device, the loss times ``scale``
(:func:`jaxdp._forward.micro_forward`)."""


class Reduced(NamedTuple):
    """A window's sums made global by :func:`reduce` (on the logical arrays after the
    map: the whole leaves replicated, the split ones each device's block).

    Attributes:
      sums: the window with every device's sums added: gradients, loss, weight and aux;
        ``batch_stats`` device 0's, on the wire (:func:`jaxdp._model_state.wire_dtype`).
      squares: the squared global norm of ``sums.grads``, which the reduction adds.
    """

    sums: Window
    squares: jax.Array


class Update(NamedTuple):
    """What stage 3 hands to the end of the call.

    Attributes:
      params: the trainable parameters after the step.
      opt_state: the optimizer state after the step.
      batch_stats: the committed batch statistics after the step.
      applied: an update was applied (not skipped; on multisteps: the window ended).
      skipped: an update was due but skipped: non-finite gradients, loss or statistics.
      report: the update's :class:`Report` (a multisteps call that ends no window: the
        last one's).
    """

    params: Any
    opt_state: Any
    batch_stats: Any
    applied: jax.Array
    skipped: jax.Array
    report: Report


class Routing(NamedTuple):
    """The stacks of layers (``Parallel.layers``) whose gradients leave
    :func:`jaxdp.scan_layers`' backward layer by layer, reduced there (stages 0 to 2,
    the plain spelling), on the micro-batches that communicate: the window's last at
    stages 0 and 1 (its sums added first), every one at stage 2."""

    routed: tuple[bool, ...]  # per trainable leaf
    plan: ShardPlan
    route: Route
    dtype: Any  # the accumulator's
    names: tuple[str, ...]  # per trainable leaf, as keystr writes its path
    with_sums: bool  # stages 0 and 1: the window's sums travel with the last one

    def sinks(self, trainable: Any) -> list[jax.Array]:
        """Zeros in the reduced gradients' shapes (a block at stages 1 to 3), whose
        gradients the routed leaves' reduced gradients come out as."""
        leaves, out = self.plan.treedef.flatten_up_to(trainable), []
        reduced = self.route.axes if isinstance(self.route.axes, tuple) else (self.route.axes,)
        # A block differs per device of the axes it is not summed over (the shard axis).
        varying = tuple(a for a in self.plan.data_axes if a not in reduced)
        if self.route.kind == "scatter":
            varying = reduced
        for x, d, r in zip(leaves, self.plan.dims, self.routed, strict=True):
            if r:
                shape = list(x.shape)
                if self.route.kind == "scatter":
                    shape[d] //= self.route.n
                zeros = jnp.zeros(shape, self.dtype)
                out.append(mark_varying(zeros, varying) if varying else zeros)
        return out

    def hand(self, trainable: Any, sums: Any, sinks: list[jax.Array]) -> Any:
        """``trainable`` with the routed leaves as :class:`jaxdp._layers.Stack`."""
        leaves = self.plan.treedef.flatten_up_to(trainable)
        summed = [None] * len(leaves) if sums is None else self.plan.treedef.flatten_up_to(sums)
        it = iter(sinks)
        for i, (x, s, r) in enumerate(zip(leaves, summed, self.routed, strict=True)):
            if r:
                dim = None if self.route.kind == "psum" else self.plan.dims[i] - 1
                s = None if s is None else s.reshape(x.shape)
                model = tuple(self.plan.model[i][1:])  # a layer's: behind the layer axis
                leaves[i] = Stack(x, s, next(it), dim, self.route, self.names[i], model=model)
        return self.plan.treedef.unflatten(leaves)

    def merge(self, grads: Any, sunk: list[jax.Array]) -> Any:
        """``grads`` with the routed leaves' reduced gradients in place."""
        leaves, it = self.plan.treedef.flatten_up_to(grads), iter(sunk)
        return self.plan.treedef.unflatten(
            [next(it) if r else g for g, r in zip(leaves, self.routed, strict=True)]
        )


def _routing(o: StepOptions, plan: ShardPlan, trainable: Any) -> Routing | None:
    """The step's :class:`Routing`, None where nothing is routed: no stack of layers,
    XLA:CPU's spelling (its collectives are synchronous: nothing would overlap), pmap,
    plain stage 3 (its gathers' backward reduce-scatters each layer already), or a stack
    no dimension of which but the layer axis splits (stages 1 and 2). Under HSDP (stage
    3 on replicas x shards, gathered per micro-batch, ``replica_all_reduce="per_layer"``)
    with a stack declared, every split
    leaf is routed: its reduce-scattered block goes on across the replica groups in the
    same backward, with the window's sums (the stack's layer by layer, in
    :func:`jaxdp.scan_layers`; the others whole, as their gradient completes)."""
    layout, hsdp = o.layout, plan.replica_axis is not None and plan.split
    if o.cpu_spelling or o.parallel.strategy != "shard_map":
        return None
    per_layer = o.parallel.replica_all_reduce == "per_layer"
    if layout.params_split and not (hsdp and per_layer and any(plan.stacked)):
        return None
    if o.regathers_per_window:
        return None
    routed = tuple(
        (d is not None)
        if layout.params_split
        else bool(s) and (not layout.state_split or (d is not None and d >= 1))
        for s, d in zip(plan.stacked, plan.dims, strict=True)
    )
    if not any(routed):
        return None
    if layout.params_split:
        r = plan.mesh.shape[plan.replica_axis]
        route = Route("psum", plan.replica_axis, r, o.comm, model_axes=o.model_axes)
    elif not layout.state_split:
        route = Route(
            "psum", plan.data_axes, plan.data_size, o.comm, packed=True, model_axes=o.model_axes
        )
    else:
        route = Route(
            "scatter",
            plan.axis_name,
            plan.num_devices,
            o.comm,
            packed=True,
            model_axes=o.model_axes,
        )
    paths = jax.tree_util.tree_flatten_with_path(trainable)[0]
    names = tuple(jax.tree_util.keystr(p) for p, _ in paths)
    dtype = o.accumulator_dtype(trainable)
    with_sums = not o.scatters_per_micro_batch
    return Routing(routed, plan, route, dtype, names, with_sums=with_sums)


class _Parts(NamedTuple):
    """What a call trains, and how it lies on the mesh."""

    mask: tuple[bool, ...]  # per parameter leaf: trains
    trainable: Any  # the parameters, frozen leaves replaced by optax.MaskedNode()
    batch_stats: Any  # the committed nnx.BatchStat values (None without any)
    plan: ShardPlan
    routing: Routing | None  # the stacks whose gradients leave the loop layer by layer

    @property
    def declared(self) -> list[bool]:
        """Per parameter leaf: a stack of layers (``Parallel.layers``; frozen: no)."""
        stacked = iter(self.plan.stacked)
        return [next(stacked) if trains else False for trains in self.mask]

    @property
    def dims(self) -> list[int | None]:
        """Per parameter leaf, the dimension it is split along at rest: the plan's where
        the parameters rest split (stage 3), else None (whole)."""
        return self._per_parameter(self.plan.dims)

    @property
    def sizes(self) -> list[int | None]:
        """Per parameter leaf, the logical size along that dimension of a leaf that rests
        padded (stage 3), else None."""
        return self._per_parameter(self.plan.sizes)

    @property
    def models(self) -> list[tuple[Any, ...]]:
        """Per parameter leaf, its split over the model axes where the parameters rest
        split (stage 3; :func:`jaxdp._shards.model_specs`), else none."""
        return [m or () for m in self._per_parameter(self.plan.model)]

    def _per_parameter(self, per_trainable: list[Any]) -> list[Any]:
        if not self.plan.layout.params_split:
            return [None] * len(self.mask)
        it = iter(per_trainable)
        return [next(it) if trains else None for trains in self.mask]


def _parts(o: StepOptions, state: TrainState) -> _Parts:
    logical = logical_params(state)
    mask = trainable_mask(logical, o.trainable)
    trainable = split_trainable(state.params, mask)
    plan = o.plan(split_trainable(logical, mask))
    stats = split_state(state.model_state)[0]
    return _Parts(mask, trainable, stats, plan, _routing(o, plan, trainable))


def routes_a_stack(o: StepOptions, state: TrainState) -> bool:
    """Whether the step's program for ``state`` sends a declared stack's gradients layer
    by layer from :func:`jaxdp.scan_layers`' backward (its :class:`Routing`): what the
    program's compiler options depend on (:meth:`StepOptions.compiler_options`). Read
    from the shapes and metadata of ``state``, as the step traces it."""
    return _parts(o, state).routing is not None


def _check_rest(o: StepOptions, parts: _Parts) -> None:
    """The trainable leaves in the shapes this step holds them in (stage 3: padded as it
    pads them; elsewhere the model's), while JAX traces: free on later calls."""
    step = f"zero_stage={o.zero_stage}" + (f", shards={o.shards}" if o.parallel.shards else "")
    check_params_layout(parts.trainable, parts.plan.rest, parts.plan.shapes, step=step)


def _param_specs(o: StepOptions, parts: _Parts, params: Any, *, rest: bool = False) -> Any:
    """How the parameters lie over the data axis (inside the mesh map): replicated, but
    the split trainable leaves at stage 3. ``rest``: as they rest outside it, with each
    leaf's split over the model axes (a frozen leaf's too)."""
    data = [spec(d, o.axis_name) for d in parts.dims]
    if rest and o.model_axes:
        data = [merged(s, m) for s, m in zip(data, model_specs(params, o.model_axes), strict=True)]
    return jax.tree.structure(params).unflatten(data)


# ---- the two paths ---------------------------------------------------------------------


def fused_call(
    o: StepOptions, state: TrainState, batch: Any, micro_weights: jax.Array
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step over a global batch: accumulate and reduce on every device,
    then update and end."""
    # While JAX traces a new input structure only: free on later calls.
    check_state_layout(state, path=o.path, expected_opt_state=opt_state_like(o, state))
    parts = _parts(o, state)
    _check_rest(o, parts)
    result = _fused(o, parts, state, batch, micro_weights)
    return end(o, state, parts, result, state.window)


def _fused(
    o: StepOptions, parts: _Parts, state: TrainState, batch: Any, micro_weights: jax.Array
) -> Update:
    """Stages 1 to 3 of a fused call: the call's micro-batches accumulated and reduced in
    one mesh map, then the update (the multisteps path's ``accum_steps=1`` runs it too)."""
    k = o.accum_steps

    def per_device(params, model_state, step, batch, weights):
        micro = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), batch)
        if o.regathers_per_window:  # stage 3: whole for the window, gathered once here
            params = gather_window(parts, params, o)
        forward = _forward(o, parts, params, model_state, step, state.graphdef)
        window = accumulate(o, parts, forward, params, model_state, micro, weights)
        return reduce(
            parts.plan, window, scattered=o.layout.window_split, wire=o.comm, done=_done(parts)
        )

    in_specs = (_param_specs(o, parts, state.params), P(), P(), P(o.batch_axes), P())
    mapped = mesh_map(o, per_device, in_specs, _reduced_specs(parts))
    reduced = mapped(state.params, state.model_state, state.step, batch, micro_weights)
    return update(o, parts, state, reduced)


def multisteps_call(
    o: StepOptions, state: TrainState, batch: Any, micro_weight: jax.Array
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One micro-batch of a window of ``accum_steps`` calls; the last one updates."""
    # While JAX traces a new input structure only: free on later calls.
    check_state_layout(state, path=o.path, expected_opt_state=opt_state_like(o, state))
    parts = _parts(o, state)
    if o.accum_steps == 1:
        # Every call ends its window: the fused call on this micro-batch. The window's
        # sums stay the zeros they start as (no pass over them: the fused step's speed).
        _check_rest(o, parts)
        result = _fused(o, parts, state, batch, micro_weight[None])
        check_aux(state.window.last.aux, result.report.aux, recorded_at=_AUX_IN_WINDOW)
        last = _select(result.skipped, state.window.last, result.report)
        window = _cast_like(state.window, state.window._replace(last=last))
        new, metrics = end(o, state, parts, result, window)
        return new, {**metrics, "emitted": jnp.ones([], bool)}
    logical = split_trainable(logical_params(state), parts.mask)
    expected = jax.eval_shape(lambda t: empty_window(o, t, {}, jnp.float32).grads, logical)
    check_window_layout(
        state.window.grads,
        expected,
        parts.trainable,
        num_devices=o.num_devices,
        zero_stage=o.zero_stage,
        shards=o.parallel.shards,
    )
    _check_rest(o, parts)
    specs = _window_specs(o, parts, state.window)

    def per_device(params, model_state, step, window, batch, weight, *, ends=False):
        # 1. accumulate: this micro-batch into the device's block of the window
        committed = to_varying(o)(split_state(model_state)[0])
        first = window.position == 0
        stats = jax.tree.map(lambda c, b: jnp.where(first, c, b[0]), committed, window.batch_stats)
        routing = parts.routing if ends or o.scatters_per_micro_batch else None
        window = add_micro_batch(
            _forward(o, parts, params, model_state, step, state.graphdef),
            to_varying(o)(split_trainable(params, parts.mask)),
            window._replace(batch_stats=stats),
            batch,
            weight,
            scatter=_scatter(o, parts.plan, routing),
            routing=routing,
        )
        return window._replace(batch_stats=jax.tree.map(lambda x: x[None], window.batch_stats))

    in_specs = (_param_specs(o, parts, state.params), P(), P(), specs, P(o.batch_axes), P())
    mapped = mesh_map(o, per_device, in_specs, specs)

    def add(window: Window) -> Window:
        return mapped(state.params, state.model_state, state.step, window, batch, micro_weight)

    def ending(window: Window) -> Update:
        # 2. reduce, 3. update: on the window's last call only
        reduce_window = functools.partial(_reduce_window, o, parts)
        in_specs = (specs._replace(last=None),)
        mapped = mesh_map(o, reduce_window, in_specs, _reduced_specs(parts))
        return update(o, parts, state, mapped(window._replace(last=None)))

    def open_(window: Window) -> Update:
        no = jnp.zeros([], bool)
        return Update(parts.trainable, state.opt_state, parts.batch_stats, no, no, window.last)

    if o.cpu_spelling:
        # XLA:CPU spelling of "the last call's micro-batch inside its branch": the
        # micro-batch before the branch. XLA:CPU runs collectives synchronously, so
        # nothing could hide under its backward, and the forward and backward would be
        # compiled once per branch.
        window = add(state.window)
        ends = window.position == o.accum_steps
        like = jax.eval_shape(ending, window)
        result = jax.lax.cond(ends, ending, lambda w: _cast_like(like, open_(w)), window)
    else:
        # The window's last call adds its micro-batch inside the branch that reduces:
        # the backward and the gradient collectives are one region of the program, so
        # XLA schedules each bucket under the rest of the backward, as on the fused path.
        def last(window: Window) -> tuple[Window, Update]:
            if parts.routing is None:
                window = add(window)
                return window, ending(window)

            # A stack's layers reduced in its loop's backward: the add and the reduction
            # in one map (a routed gradient comes out reduced, at stage 1 a block). The
            # window returned is the one the call began with: it restarts.
            def add_and_reduce(*args):
                added = per_device(*args, ends=True)
                return _reduce_window(o, parts, added._replace(last=None), done=_done(parts))

            reduced = mesh_map(o, add_and_reduce, in_specs, _reduced_specs(parts))(
                state.params, state.model_state, state.step, window, batch, micro_weight
            )
            return window, update(o, parts, state, reduced)

        def inside(window: Window) -> tuple[Window, Update]:
            window = add(window)
            return window, open_(window)

        ends = state.window.position == o.accum_steps - 1
        like = jax.eval_shape(last, state.window)
        window, result = jax.lax.cond(
            ends, last, lambda w: _cast_like(like, inside(w)), state.window
        )
    new, metrics = end(o, state, parts, result, _restarted(o, window, ends, result))
    return new, {**metrics, "emitted": ends}


# ---- 1. accumulate (per device) -------------------------------------------------------

_AUX_IN_WINDOW = (
    "at init(..., batch=...) (the open multisteps window holds its sums in the state, "
    "and checkpoints keep them)"
)
_AUX_IN_CALL = (
    "from loss_fn's first trace in this call (the call's loop over its micro-batches "
    "adds each one's aux into sums of that structure)"
)


def add_micro_batch(
    forward: Forward,
    trainable: Any,
    window: Window,
    batch: Any,
    scale: jax.Array,
    *,
    scatter: Callable[[Any], Any],
    routing: Routing | None = None,
) -> Window:
    """``window`` plus one micro-batch, its position one further.

    ``scale`` is its weight in the window: 1, or 0 for a padding micro-batch that
    fills an incomplete last window (it then adds nothing and leaves the batch
    statistics as they were). The loss is scaled, not the gradients: a pass less.
    ``window``'s leaves are this device's: unbatched (fused), or its ``[1, ...]``
    block of a per-device leaf (multisteps), or at ZeRO stages 2 and 3 its block of a
    split leaf; ``scatter`` reduce-scatters the gradients into that block at stage 2
    (at stage 3 the forward's gather did, in its backward: :mod:`jaxdp._layers`).
    ``routing``: this micro-batch communicates, and the stacks of layers reduce their
    gradients in :func:`jaxdp.scan_layers`' backward (:class:`Routing`); at stages 0
    and 1 the window's sums travel with them, and a routed leaf's entry is then its
    reduced sum (a block at stage 1), for :func:`reduce` to leave (``done``).
    """
    sums = window.grads if routing is not None and routing.with_sums else None
    grads, value, weight, stats, aux = forward(
        trainable,
        batch,
        window.batch_stats,
        window.position,
        scale,
        route=routing is not None,
        sums=sums,
    )
    # The sums' leaves are per-device [1, ...] blocks where the loss sum is (multisteps).
    blocks = window.loss_sum.ndim
    check_aux(window.aux, aux, recorded_at=_AUX_IN_WINDOW if blocks else _AUX_IN_CALL, lead=blocks)
    dtype = window.loss_sum.dtype
    grads = scatter(jax.tree.map(lambda g: g.astype(dtype), grads))
    # In the carried dtype: a Linen BatchNorm writes its forward's (flax's bridge modules).
    stats = jax.tree.map(
        lambda n, o: jnp.where(scale > 0, n.astype(o.dtype), o), stats, window.batch_stats
    )
    scale = scale.astype(dtype)
    return window._replace(
        # Added in the block's own shape: XLA:CPU adds in place into the donated buffer
        # only then (tests/core/test_streaming_program.py: no copy of a parameter's size in
        # a call that does not end the window). One spelling everywhere: the reshape is a
        # bitcast.
        grads=_added(window.grads, grads, routing),
        loss_sum=window.loss_sum + value.astype(dtype),
        weight=window.weight + weight.astype(dtype) * scale,
        batch_stats=stats,
        position=window.position + 1,
        aux=jax.tree.map(lambda s, a: s + jnp.asarray(a, dtype) * scale, window.aux, aux),
    )


def accumulate(
    o: StepOptions,
    parts: _Parts,
    forward: Forward,
    params: Any,
    model_state: Any,
    micro_batches: Any,
    micro_weights: jax.Array,
) -> Window:
    """A whole window in one call (the ``fused`` path): a ``lax.scan`` over this
    device's ``[accum_steps, micro_batch_size, ...]`` rows.

    The replicated parameters are marked per-device before the loop: without it
    (``shard_map`` with ``check_vma``) JAX treats them as invariant and the transpose of
    their implicit broadcast is a psum: an all-reduce inside the loop, one per
    micro-batch.
    """
    dtype = o.accumulator_dtype(params)
    scatter = _scatter(o, parts.plan)
    # Every micro-batch communicates where the step scatters each one (stage 2).
    each = parts.routing if o.scatters_per_micro_batch else None
    trainable = split_trainable(params, parts.mask)
    local = to_varying(o)(trainable)
    stats = split_state(model_state)[0]
    like = jax.eval_shape(scatter, jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), trainable))
    aux = None
    if o.has_aux:  # its shapes, from a trace of the first micro-batch's forward
        first = jax.tree.map(lambda x: x[0], micro_batches)
        aux = jax.eval_shape(forward, local, first, stats, 0, micro_weights[0])[-1]
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, dtype), (like, aux))
    sums = (zeros[0], jnp.zeros([], dtype), jnp.zeros([], dtype), stats, zeros[1])
    sums = to_varying(o)(sums)
    window = Window(*sums[:4], position=jnp.zeros([], jnp.int32), last=None, aux=sums[4])

    def body(window, inputs, routing=each):
        batch, scale = inputs
        scattered = _scatter(o, parts.plan, routing)
        added = add_micro_batch(
            forward, local, window, batch, scale, scatter=scattered, routing=routing
        )
        return added, None

    if o.cpu_spelling:
        # XLA:CPU spelling of "the last micro-batch after the loop": every one in the
        # loop. XLA:CPU runs collectives synchronously, so nothing can hide under the
        # last backward, and a second copy of the forward and backward outside the
        # loop only costs its trace and compile. Also for one micro-batch: without
        # the loop XLA kept 19% more temporaries on the digits CNN (docs/decisions.md).
        return jax.lax.scan(body, window, (micro_batches, micro_weights))[0]
    # The last micro-batch after the loop: its backward and the reduction after it are
    # one region of the program, so XLA schedules each gradient collective as soon as
    # its gradients are done, under the rest of that backward (DDP's buckets).
    rest, (batch, scale) = _split_last((micro_batches, micro_weights))
    window = jax.lax.scan(body, window, rest)[0]
    # After the loop, not before: XLA would otherwise compute the last forward first and
    # hold its activations through the loop.
    grads, batch = jax.lax.optimization_barrier((window.grads, batch))
    return body(window._replace(grads=grads), (batch, scale), routing=parts.routing)[0]


# ---- 2. reduce (per device) ----------------------------------------------------------------


def reduce(
    plan: ShardPlan, window: Window, *, scattered: bool, wire: Any = None, done: Any = None
) -> Reduced:
    """The global sums of every device's ``window``: the step's one gradient reduction.

    Replicated (stage 0): ONE psum of the gradient sums, the loss and weight sums (and
    ``loss_fn``'s aux sums) and device 0's batch statistics: a collective per leaf, which
    XLA combines into buckets (one on XLA:CPU). Split (ZeRO stages 1 to 3): the
    reduce-scatter of the split leaves' sums (at stages 2 and 3 already done per
    micro-batch, in stage 1: ``scattered``; packed into one per dtype on XLA:CPU, else
    one per leaf for XLA to bucket: :class:`ShardPlan`), then one small psum of the leaves kept
    whole, the loss, weight and aux sums, device 0's batch statistics and the split
    blocks' sum of squares (for the global gradient norm). ``wire`` (bfloat16) sends
    the gradients narrow, as torch's ``bf16_compress_hook`` does.

    HSDP (a replica axis): the blocks hold their shard group's sums, so first ONE
    all-reduce of the blocks across the replica groups (the window's only one: DDP's
    ``no_sync`` until here), then the small psum over every device, which counts the
    blocks' squares once (replica group 0's).

    ``done``: per leaf, reduced already (in :func:`jaxdp.scan_layers`' backward, layer
    by layer: :class:`Routing`), left as it is.
    """
    axes, n, dtype = plan.data_axes, plan.data_size, window.loss_sum.dtype
    grads = window.grads if scattered else plan.reduce_scatter(window.grads, wire, done)
    grouped = plan.replica_axis is not None and plan.split
    done = done or (False,) * len(plan.dims)
    if grouped:
        r, blocks = plan.mesh.shape[plan.replica_axis], plan.blocks(grads)
        sent = [not d for d in plan.blocks(plan.treedef.unflatten(done))]
        summed = iter(
            psum(
                [compress(x, wire, r) for x, s in zip(blocks, sent, strict=True) if s],
                plan.replica_axis,
            )
        )
        blocks = [
            decompress(next(summed), b.dtype, wire, r) if s else b
            for b, s in zip(blocks, sent, strict=True)
        ]
        grads = plan.with_blocks(grads, blocks)
    whole = plan.whole(grads)
    done = plan.whole(plan.treedef.unflatten(done))
    sent = [x for x, d in zip(whole, done, strict=True) if not d]
    dtypes = [x.dtype for x in sent]
    payload = [[compress(x, wire, n) for x in sent], window.loss_sum, window.weight]
    payload += [device0(window.batch_stats, axes, dtype), window.aux]
    if plan.split:
        squares = _squares(plan.blocks(grads), dtype)
        if grouped:  # every replica group holds them now: counted once
            squares = jnp.where(jax.lax.axis_index(plan.replica_axis) == 0, squares, 0)
        payload.append(squares)
    summed = psum(tuple(payload), axes)
    received = iter([decompress(x, d, wire, n) for x, d in zip(summed[0], dtypes, strict=True)])
    whole = [x if d else next(received) for x, d in zip(whole, done, strict=True)]
    squares = _squares(whole, dtype)
    if plan.split:
        squares = summed[5] + squares
    sums = window._replace(
        grads=plan.with_whole(grads, whole),
        loss_sum=summed[1],
        weight=summed[2],
        batch_stats=summed[3],
        aux=summed[4],
    )
    return Reduced(sums, squares)


def _reduce_window(o: StepOptions, parts: _Parts, window: Window, done: Any = None) -> Reduced:
    """:func:`reduce` on this device's block of the multisteps window (its leading
    axis of 1 dropped; a split leaf at stages 2 and 3 is a block of its own shape, and
    so is a leaf ``done``: reduced already, in its own shape)."""
    scattered, grouped = o.layout.window_split, parts.plan.replica_axis is not None
    leaves = parts.plan.treedef.flatten_up_to(window.grads)
    done = done or (False,) * len(leaves)
    grads = parts.plan.treedef.unflatten(
        [
            x if (scattered and d is not None and not grouped) or r else x[0]
            for x, d, r in zip(leaves, parts.plan.dims, done, strict=True)
        ]
    )
    rows = jax.tree.map(lambda x: x[0], (window.loss_sum, window.weight, window.batch_stats))
    window = window._replace(grads=grads, loss_sum=rows[0], weight=rows[1], batch_stats=rows[2])
    window = window._replace(aux=jax.tree.map(lambda x: x[0], window.aux))
    return reduce(parts.plan, window, scattered=scattered, wire=o.comm, done=done)


def _squares(leaves: list[Any], dtype: Any) -> jax.Array:
    """The sum of squares of ``leaves``, as ``optax.tree.norm`` adds them."""
    return sum((jnp.sum(jnp.square(x)) for x in leaves), jnp.zeros([], dtype))


# ---- 3. update (on the logical arrays) -------------------------------------------------


def update(o: StepOptions, parts: _Parts, state: TrainState, reduced: Reduced) -> Update:
    """Applies the optimizer to the mean of ``reduced``'s gradient sums, or skips: with
    ``Skips(nonfinite=True)``, a NaN or Inf in the gradients (by their norm), the loss or
    the batch statistics leaves parameters, optimizer state and statistics as they were.

    The finiteness is of all-reduced values, so every device decides the same; a NaN or
    Inf on any device, or an overflow of a sum, makes it non-finite. At ZeRO stages 1
    to 3 each device updates its block of every split leaf with its block of the
    optimizer state, and XLA (GSPMD) inserts what a transform that reads beyond an
    element needs (the scalar sums of a global-norm clip, a trust ratio's norms); then
    at stages 1 and 2 one all-gather per parameter dtype returns the whole parameters;
    at stage 3 they stay split (``plan.at_rest``).
    """
    sums, plan, skip_nonfinite = reduced.sums, parts.plan, o.skips.nonfinite
    weight = sums.weight
    loss = sums.loss_sum / weight.astype(sums.loss_sum.dtype)
    # Zero padding (stage 3) adds nothing to the blocks' squares: the norm is the logical one.
    grad_norm = jnp.sqrt(reduced.squares) / weight
    stats_ok = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(sums.batch_stats)]
    finite = jnp.all(jnp.stack([jnp.isfinite(grad_norm), jnp.isfinite(loss), *stats_ok]))
    ok = finite if skip_nonfinite else jnp.ones([], bool)
    # Stage 3's padded leaves are sliced to the model's shapes before the optimizer (an
    # uneven sharding inside jit: no collective) and padded back after it, so that it
    # sees the logical arrays (adafactor's factored moments average over a dimension).
    opt_like = opt_state_like(o, state) if o.layout.pads else None

    def apply(operands: tuple[Any, Any]) -> tuple[Any, Any]:
        params, opt_state = plan.unpad(operands[0]), plan.unpad_state(operands[1], opt_like)
        mine = plan.local(params)
        opt_state = plan.constrain(opt_state)
        summed = plan.unpad(sums.grads)
        if o.cpu_spelling:
            # XLA:CPU spelling of sums / weight: a multiply by 1 / weight, which XLA
            # repeats inside each consumer (AdamW's two moment updates), where it computed
            # a divide once and wrote it out: a pass over the gradients, 0.4 ms of a 4.3
            # ms MLP step. At most one rounding apart, none for a power-of-two weight.
            inverse = 1 / weight
            grads = jax.tree.map(
                lambda g, p: (g * inverse.astype(g.dtype)).astype(p.dtype), summed, mine
            )
        else:
            grads = jax.tree.map(
                lambda g, p: (g / weight.astype(g.dtype)).astype(p.dtype), summed, mine
            )
        updates, opt_state = o.applied_optimizer.update(grads, opt_state, mine)
        params = plan.at_rest(optax.apply_updates(mine, updates))
        return params, plan.constrain(plan.pad_state(opt_state))

    operands = (parts.trainable, state.opt_state)
    if not skip_nonfinite:
        params, opt_state = apply(operands)
    elif o.cpu_spelling:
        # XLA:CPU spelling of "apply if ok": a lax.cond. A select over parameters and
        # optimizer state cost 1.3 ms of a 6.6 ms MLP step; a branch not taken costs
        # nothing. Elsewhere a select: a conditional reads its predicate on the host
        # (XLA:GPU), a round trip per step, where the select is a pass at memory speed.
        like = jax.eval_shape(apply, operands)
        params, opt_state = jax.lax.cond(ok, apply, lambda x: _cast_like(like, x), operands)
    else:
        like = jax.eval_shape(apply, operands)
        params, opt_state = _select(ok, apply(operands), _cast_like(like, operands))
    committed = from_wire(sums.batch_stats, parts.batch_stats)
    stats = _select(ok, committed, parts.batch_stats)
    aux = jax.tree.map(lambda x: x / weight.astype(x.dtype), sums.aux)
    return Update(params, opt_state, stats, ok, ~ok, Report(loss, grad_norm, finite, aux))


# ---- 4. end ---------------------------------------------------------------------------


def end(
    o: StepOptions, state: TrainState, parts: _Parts, result: Update, window: Window | None
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The state after one call, laid out as the step keeps it, and its metrics (the
    update's :class:`Report` and the skip counters)."""
    count = state.step.dtype
    skips = SkipCounts(
        skipped_steps=state.skipped_steps + result.skipped.astype(count),
        consecutive_skips=jnp.where(
            result.skipped,
            state.consecutive_skips + 1,
            jnp.where(result.applied, 0, state.consecutive_skips),
        ).astype(count),
    )
    model_state = state.model_state
    if model_state is not None:
        _, rngs, constants = split_state(model_state)
        model_state = nnx.merge_state(result.batch_stats, rngs, constants)
    new = TrainState(
        step=state.step + result.applied.astype(count),
        params=combine(result.params, state.params, parts.mask),
        opt_state=result.opt_state,
        window=window,
        graphdef=state.graphdef,
        model_state=model_state,
        skips=skips,
        logical=state.logical,
    )
    shardings = jax.tree.map(
        lambda s: NamedSharding(o.device_mesh, s), state_specs(o, new), is_leaf=is_spec
    )
    new = jax.lax.with_sharding_constraint(new, shardings)
    metrics = result.report._asdict()
    if not o.has_aux:
        del metrics["aux"]
    lr = _learning_rate(result.opt_state)
    if lr is not None:
        metrics["learning_rate"] = lr
    metrics.update(skipped=result.skipped, **skips._asdict())
    return new, metrics


def _restarted(o: StepOptions, window: Window, ends: jax.Array, result: Update) -> Window:
    """The window after a multisteps call: its sums zero and its position 0 where it
    ended; the last update's report kept for the calls of the next window."""
    if o.cpu_spelling:
        # XLA:CPU spelling of "zeros where ends": zeros computed from the sums
        # (where(finite, abs(a) * 0, 0): +0 for every element, NaN and Inf included), in a
        # branch of their own, ordered after the update read them (by its norm): fresh
        # zeros, or a reset inside the update's branch, made XLA:CPU copy the sums on
        # every call, the ones that do not end the window included.
        after = result.report.grad_norm
        grads = jax.lax.cond(ends, _zeros_from, lambda o: o[0], (window.grads, after))
    else:
        grads = jax.lax.cond(ends, _zeros, lambda s: s, window.grads)
    zero = functools.partial(jax.tree.map, lambda x: jnp.where(ends, 0, x))
    return window._replace(
        grads=grads,
        loss_sum=zero(window.loss_sum),
        weight=zero(window.weight),
        batch_stats=zero(window.batch_stats),
        position=zero(window.position),
        last=_select(result.applied, result.report, window.last),
        aux=zero(window.aux),
    )


def _zeros(sums: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, sums)


def _zeros_from(operands: tuple[Any, jax.Array]) -> Any:
    sums, after = operands
    ordered = jnp.isfinite(after)

    def zero(a):
        return jnp.where(ordered & jnp.isfinite(a), jnp.abs(a) * 0, 0).astype(a.dtype)

    return jax.tree.map(zero, sums)


# ---- the state on the mesh, and how it starts -----------------------------------------


def logical_params(state: TrainState) -> Any:
    """``state.params`` with each leaf that rests padded (stage 3, ``state.logical``) as a
    ``jax.ShapeDtypeStruct`` of the model's shape of it: what the plan, the trainable mask
    and the optimizer's ``init`` read."""
    if state.logical is None:
        return state.params
    leaves, treedef = jax.tree.flatten(state.params)
    return treedef.unflatten(
        [
            x if s is None else jax.ShapeDtypeStruct(s, x.dtype)
            for x, s in zip(leaves, state.logical.params, strict=True)
        ]
    )


def logical_shapes(o: StepOptions, params: Any, mask: tuple[bool, ...]) -> LogicalShapes | None:
    """The :class:`jaxdp.TrainState` ``logical`` record of ``params`` (the model's
    shapes) at this step's layout: the parameters' and the optimizer state's leaves that
    rest padded (:meth:`ShardPlan.pad`, :meth:`ShardPlan.pad_state`); None where none does."""
    trainable = split_trainable(params, mask)
    plan = o.plan(trainable)
    if not (plan.split and o.layout.pads):
        return None
    sizes = iter(plan.sizes)
    own = tuple(
        tuple(x.shape) if trains and next(sizes) is not None else None
        for x, trains in zip(jax.tree.leaves(params), mask, strict=True)
    )
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), trainable)
    opt_state = jax.eval_shape(o.applied_optimizer.init, shapes)
    rested = jax.eval_shape(plan.pad_state, opt_state)
    opt_own = tuple(
        None if x.shape == r.shape else tuple(x.shape)
        for x, r in zip(jax.tree.leaves(opt_state), jax.tree.leaves(rested), strict=True)
    )
    if all(x is None for x in own + opt_own):
        return None
    return LogicalShapes(own, opt_own)


def opt_state_like(o: StepOptions, state: TrainState) -> Any:
    """The optimizer state the step's ``init`` builds for ``state``'s parameters, in the
    logical shapes (before stage 3 pads it)."""
    logical = logical_params(state)
    mask = trainable_mask(logical, o.trainable)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), split_trainable(logical, mask)
    )
    return jax.eval_shape(o.applied_optimizer.init, abstract)


def state_specs(o: StepOptions, state: TrainState) -> TrainState:
    """How every leaf of ``state`` lies on the mesh: replicated, but the window's
    per-device sums and, at ZeRO stages, the split leaves (the parameters' at stage 3)."""
    parts = _parts(o, state)
    window = state.window
    if window is not None:
        window = _window_specs(o, parts, window, rest=True)
    return TrainState(
        step=P(),
        params=_param_specs(o, parts, state.params, rest=True),
        opt_state=parts.plan.state_specs(state.opt_state),
        window=window,
        graphdef=state.graphdef,
        model_state=jax.tree.map(lambda _: P(), state.model_state),
        skips=SkipCounts(P(), P()),
        logical=state.logical,
    )


def empty_window(
    o: StepOptions, trainable: Any, batch_stats: Any, dtype: Any, aux: Any = None
) -> Window:
    """A window with nothing added: per-device zero sums (at stages 2 and 3 the split
    leaves' global sums, each device its block; at stage 3 padded as the parameter rests),
    the committed statistics' shapes per device; ``aux``: the shapes of ``loss_fn``'s aux
    (:func:`aux_like`). ``trainable`` in the model's (logical) shapes."""
    n = o.num_devices

    def rows(x: Any) -> jax.Array:
        return jnp.zeros((n, *x.shape), dtype)

    grads = jax.tree.map(rows, trainable)
    if o.layout.window_split:
        plan = o.plan(trainable)
        leaves = plan.treedef.flatten_up_to(trainable)
        # HSDP: each replica group's own sum of a split leaf until the window ends.
        groups = () if plan.replica_axis is None else (o.num_devices // o.shards,)
        grads = plan.treedef.unflatten(
            [
                rows(x) if d is None else jnp.zeros((*groups, *r), dtype)
                for x, d, r in zip(leaves, plan.dims, plan.rest, strict=True)
            ]
        )
    zero = jnp.zeros([], dtype)
    return Window(
        grads=grads,
        loss_sum=jnp.zeros([n], dtype),
        weight=jnp.zeros([n], dtype),
        batch_stats=jax.tree.map(lambda x: jnp.zeros((n, *x.shape), x.dtype), batch_stats),
        position=jnp.zeros([], jnp.int32),
        last=Report(
            zero, zero, jnp.ones([], bool), jax.tree.map(lambda x: jnp.zeros(x.shape, dtype), aux)
        ),
        aux=jax.tree.map(rows, aux),
    )


def aux_like(o: StepOptions, state: TrainState, batch: Any) -> Any:
    """The shapes of ``loss_fn``'s aux on one device's rows of ``batch`` (one call's
    micro-batch), traced and not run."""
    if batch is None:
        raise ValueError(
            "has_aux=True on the multisteps path keeps the open window's aux sums in "
            "the state: give init(..., batch=...) one call's batch (arrays or "
            "jax.ShapeDtypeStruct) so that their shapes are known"
        )
    parts = _parts(o, state)

    def per_device(params, model_state, step, batch):
        forward = _forward(o, parts, params, model_state, step, state.graphdef)
        trainable = to_varying(o)(split_trainable(params, parts.mask))
        aux = forward(trainable, batch, split_state(model_state)[0], 0, jnp.ones([]))[-1]
        return jax.tree.map(lambda x: jnp.asarray(x)[None], aux)

    in_specs = (_param_specs(o, parts, state.params), P(), P(), P(o.batch_axes))
    mapped = mesh_map(o, per_device, in_specs, P(o.batch_axes))
    shapes = jax.eval_shape(mapped, state.params, state.model_state, state.step, batch)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), shapes)


def _window_specs(o: StepOptions, parts: _Parts, window: Any, *, rest: bool = False) -> Window:
    """Per-device leaves split by their leading axis; at stages 2 and 3 the split
    gradient leaves by their plan. ``rest``: the gradient sums as they rest outside the
    mesh map, each also split over the model axes as its parameter is."""
    rows, plan = P(o.batch_axes), parts.plan
    if rest and o.model_axes:
        split, grouped = o.layout.window_split, plan.replica_axis is not None
        grads = plan.treedef.unflatten(
            [
                merged(rows, (None, *m))
                if not split or d is None
                else merged(P(plan.replica_axis, *spec(d, o.axis_name)), (None, *m))
                if grouped  # HSDP: each replica group's own sum, behind its leading axis
                else merged(spec(d, o.axis_name), m)
                for d, m in zip(plan.dims, plan.model, strict=True)
            ]
        )
    elif o.layout.window_split:
        grads = plan.window_specs(rows)
    else:
        grads = jax.tree.map(lambda _: rows, window.grads)
    return Window(
        grads=grads,
        loss_sum=rows,
        weight=rows,
        batch_stats=jax.tree.map(lambda _: rows, window.batch_stats),
        position=P(),
        last=Report(P(), P(), P(), P()),
        aux=rows,
    )


def _reduced_specs(parts: _Parts) -> Reduced:
    stats = jax.tree.map(lambda _: P(), parts.batch_stats)
    sums = Window(parts.plan.specs(), P(), P(), stats, position=P(), last=None, aux=P())
    return Reduced(sums, P())


def _forward(o: StepOptions, parts: _Parts, params, model_state, step, graphdef):
    parts_of_loss = loss_parts(
        o.loss_fn,
        o.loss_reduction,
        graphdef,
        configure=functools.partial(configure, mode=o.batch_stats, axis_name=o.batch_axes),
        context=functools.partial(linen_batch_norms, o.batch_stats, o.batch_axes),
        with_rng=o.rng_seed is not None,
        has_aux=o.has_aux,
    )
    if o.gathers_per_micro_batch:  # stage 3: gathered for the loss
        parts_of_loss = gathered_loss(
            parts_of_loss,
            parts.dims,
            _gather_how(o),
            o.warn_once,
            parts.declared,
            parts.sizes,
            parts.models,
        )
    return micro_forward(
        parts_of_loss,
        params,
        parts.mask,
        model_state,
        step,
        axis_name=o.batch_axes,
        rng_seed=o.rng_seed,
        routing=parts.routing,
    )


def _gather_how(o: StepOptions) -> Gather:
    p = o.parallel
    return Gather(
        o.axis_name,
        o.shards,
        o.comm,
        p.gather_dtype,
        p.remat,
        packed=o.cpu_spelling,
        model_axes=o.model_axes,
    )


def gather_window(parts: _Parts, params: Any, o: StepOptions) -> Any:
    """Stage 3, ``regather="window"``: every split parameter gathered whole (one
    all-gather per dtype) before the micro-batch loop and kept through it."""
    leaves, treedef = jax.tree.flatten(params)
    gathered = gather(leaves, parts.dims, _gather_how(o), parts.sizes, parts.models)
    return treedef.unflatten(gathered)


def _scatter(
    o: StepOptions, plan: ShardPlan, routing: Routing | None = None
) -> Callable[[Any], Any]:
    """ZeRO stage 2 (and stage 3 gathered per window): each micro-batch's gradients
    into this device's block of their sum, but the ``routing``'s, scattered already."""
    if o.scatters_per_micro_batch:
        done = None if routing is None else routing.routed
        return functools.partial(plan.reduce_scatter, wire=o.comm, done=done)
    return _identity


def _done(parts: _Parts) -> tuple[bool, ...] | None:
    """The leaves the window's last micro-batch reduced in its backward (stages 0 and 1;
    stage 2's were scattered as each micro-batch was added)."""
    routing = parts.routing
    return routing.routed if routing is not None and routing.with_sums else None


def _added(sums: Any, grads: Any, routing: Routing | None) -> Any:
    """The window's sums plus this micro-batch's gradients, added in the sums' own shape;
    a leaf that ``routing`` reduced with its sums is its new entry as it came."""
    if routing is None or not routing.with_sums:
        return jax.tree.map(lambda a, g: a + g.reshape(a.shape), sums, grads)
    treedef = routing.plan.treedef
    return treedef.unflatten(
        [
            g if r else a + g.reshape(a.shape)
            for a, g, r in zip(
                treedef.flatten_up_to(sums),
                treedef.flatten_up_to(grads),
                routing.routed,
                strict=True,
            )
        ]
    )


def _identity(x: Any) -> Any:
    return x


def _split_last(tree: Any) -> tuple[Any, Any]:
    """``(every row but the last, the last row)`` of each leaf's leading axis."""
    return jax.tree.map(lambda x: x[:-1], tree), jax.tree.map(lambda x: x[-1], tree)


def _select(flag: jax.Array, on_true: Any, on_false: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(flag, a, b), on_true, on_false)


def _cast_like(like: Any, tree: Any) -> Any:
    return jax.tree.map(lambda o, x: jnp.asarray(x).astype(o.dtype), like, tree)


def _learning_rate(opt_state: Any) -> jax.Array | None:
    """The learning rate held by ``optax.inject_hyperparams`` state, if any."""
    nodes = jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(getattr(x, "hyperparams", None), dict)
    )
    for node in nodes:
        hyperparams = getattr(node, "hyperparams", None)
        if isinstance(hyperparams, dict) and "learning_rate" in hyperparams:
            return hyperparams["learning_rate"]
    return None

"""One call of the step, the same four stages for every path, strategy and ZeRO stage:

1. accumulate (:mod:`._accumulate`): each device adds its micro-batches' gradients,
   losses and weights into the window's sums;
2. reduce (:mod:`._reduce`): the window's sums made global, the step's only gradient
   collective (an all-reduce; at ZeRO stages a reduce-scatter);
3. update (:mod:`._update`): the user's optimizer, or the skip, on the logical arrays;
4. end (:func:`_end`): the new state and the metrics.

``fused`` runs 1 and 2 in one mesh map (1 as a ``lax.scan`` over the call's
micro-batches), then 3 and 4. ``multisteps`` is the same pipeline cut into calls:
every call runs 1 for its micro-batch, and the window's last call also runs 2 and 3,
in one ``lax.cond`` branch that the other calls skip, and restarts the window.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._accumulate import Sums, accumulate, add_micro_batch
from ._forward import loss_parts, micro_forward
from ._frozen import combine, split_trainable, trainable_mask
from ._mesh_map import is_spec, mesh_map, to_varying
from ._model_kinds import linen_batch_norms
from ._model_state import configure, split_state
from ._options import StepOptions
from ._reduce import Reduced, reduce
from ._shards import ShardPlan
from ._train_state import LastUpdate, TrainState, Window
from ._update import Update, update


class _Parts(NamedTuple):
    """What a call trains, and how it lies on the mesh."""

    mask: tuple[bool, ...]  # per parameter leaf: trains
    trainable: Any  # the parameters, frozen leaves replaced by optax.MaskedNode()
    batch_stats: Any  # the committed nnx.BatchStat values (None without any)
    plan: ShardPlan


def _parts(o: StepOptions, state: TrainState) -> _Parts:
    mask = trainable_mask(state.params, o.trainable)
    trainable = split_trainable(state.params, mask)
    return _Parts(mask, trainable, split_state(state.model_state)[0], o.plan(trainable))


def fused_call(
    o: StepOptions, state: TrainState, batch: Any, micro_weights: jax.Array
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step over a global batch: accumulate and reduce on every device,
    then update and end."""
    parts = _parts(o, state)
    k = o.accum_steps

    def per_device(params, model_state, step, batch, weights):
        micro = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), batch)
        sums = accumulate(
            _forward(o, params, parts.mask, model_state, step, state.graphdef),
            split_trainable(params, parts.mask),
            split_state(model_state)[0],
            micro,
            weights,
            dtype=o.accumulator_dtype(params),
            scatter=_scatter(o, parts.plan),
            to_varying=to_varying(o),
            with_aux=o.has_aux,
        )
        return reduce(parts.plan, sums, scattered=o.zero_stage == 2, wire=o.comm)

    mapped = mesh_map(o, per_device, (P(), P(), P(), P(o.axis_name), P()), _reduced_specs(parts))
    reduced = mapped(state.params, state.model_state, state.step, batch, micro_weights)
    return _end(o, state, parts, _update(o, parts, state, reduced), state.window)


def multisteps_call(
    o: StepOptions, state: TrainState, batch: Any, micro_weight: jax.Array
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One micro-batch of a window of ``accum_steps`` calls; the last one updates."""
    if o.accum_steps == 1:
        # Every call ends its window: the fused call on this micro-batch. The window's
        # sums stay the zeros they start as (no pass over them: the fused step's speed).
        new, metrics = fused_call(o, state, batch, micro_weight[None])
        report = LastUpdate(*(metrics.get(k) for k in ("loss", "grad_norm", "finite", "aux")))
        last = _select(metrics["skipped"], state.window.last, report)
        new = new._replace(window=_cast_like(state.window, new.window._replace(last=last)))
        return new, {**metrics, "emitted": jnp.ones([], bool)}
    parts, window = _parts(o, state), state.window
    specs = _window_specs(o, parts, window)

    def per_device(params, model_state, step, window, batch, weight):
        committed = to_varying(o)(split_state(model_state)[0])
        first = window.position == 0
        stats = jax.tree.map(lambda c, b: jnp.where(first, c, b[0]), committed, window.batch_stats)
        sums = add_micro_batch(
            _forward(o, params, parts.mask, model_state, step, state.graphdef),
            to_varying(o)(split_trainable(params, parts.mask)),
            Sums(window.grads, window.loss_sum, window.weight, stats, window.aux),
            batch,
            weight,
            window.position,
            scatter=_scatter(o, parts.plan),
            add=o.tuning.add,
        )
        stats = jax.tree.map(lambda x: x[None], sums.batch_stats)
        return window._replace(
            grads=sums.grads,
            loss_sum=sums.loss_sum,
            weight=sums.weight,
            batch_stats=stats,
            aux=sums.aux,
        )

    in_specs = (P(), P(), P(), specs, P(o.axis_name), P())
    mapped = mesh_map(o, per_device, in_specs, specs)
    window = mapped(state.params, state.model_state, state.step, window, batch, micro_weight)
    ends = window.position == o.accum_steps - 1

    def end(window: Window) -> Update:
        def per_device(sums: Sums) -> Reduced:
            grads = _unblocked(parts.plan, sums.grads, o.zero_stage == 2)
            stats, aux = jax.tree.map(lambda x: x[0], (sums.batch_stats, sums.aux))
            sums = Sums(grads, sums.loss_sum[0], sums.weight[0], stats, aux)
            return reduce(parts.plan, sums, scattered=o.zero_stage == 2, wire=o.comm)

        sum_specs = _sums_of(specs)
        reduced = mesh_map(o, per_device, (sum_specs,), _reduced_specs(parts))(_sums_of(window))
        return _update(o, parts, state, reduced)

    def keep(window: Window) -> Update:
        no = jnp.zeros([], bool)
        return Update(parts.trainable, state.opt_state, parts.batch_stats, no, no, window.last)

    like = jax.eval_shape(end, window)
    result = jax.lax.cond(ends, end, lambda w: _cast_like(like, keep(w)), window)
    restarted = Window(
        grads=o.tuning.reset(ends, window.grads, after=result.report.grad_norm),
        loss_sum=jnp.where(ends, 0, window.loss_sum),
        weight=jnp.where(ends, 0, window.weight),
        batch_stats=jax.tree.map(lambda x: jnp.where(ends, 0, x), window.batch_stats),
        position=(window.position + 1) % o.accum_steps,
        last=_select(result.applied, result.report, window.last),
        aux=jax.tree.map(lambda x: jnp.where(ends, 0, x), window.aux),
    )
    new, metrics = _end(o, state, parts, result, restarted)
    return new, {**metrics, "emitted": ends}


def _update(o: StepOptions, parts: _Parts, state: TrainState, reduced: Reduced) -> Update:
    return update(
        o.applied_optimizer,
        reduced,
        parts.trainable,
        state.opt_state,
        parts.batch_stats,
        plan=parts.plan,
        tuning=o.tuning,
        skip_nonfinite=o.skips.nonfinite,
    )


def _end(
    o: StepOptions, state: TrainState, parts: _Parts, result: Update, window: Window | None
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The state after one call, laid out as the step keeps it, and its metrics."""
    count = state.step.dtype
    consecutive = jnp.where(
        result.skipped,
        state.consecutive_skips + 1,
        jnp.where(result.applied, 0, state.consecutive_skips),
    ).astype(count)
    skipped = state.skipped_steps + result.skipped.astype(count)
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
        skipped_steps=skipped,
        consecutive_skips=consecutive,
    )
    shardings = jax.tree.map(
        lambda s: NamedSharding(o.mesh, s), state_specs(o, new), is_leaf=is_spec
    )
    new = jax.lax.with_sharding_constraint(new, shardings)
    report = result.report
    metrics = {"loss": report.loss, "grad_norm": report.grad_norm, "finite": report.finite}
    if o.has_aux:
        metrics["aux"] = report.aux
    lr = _learning_rate(result.opt_state)
    if lr is not None:
        metrics["learning_rate"] = lr
    metrics.update(skipped=result.skipped, skipped_steps=skipped, consecutive_skips=consecutive)
    return new, metrics


def state_specs(o: StepOptions, state: TrainState) -> TrainState:
    """How every leaf of ``state`` lies on the mesh: replicated, but the window's
    per-device sums and, at ZeRO stages, the split leaves."""
    parts = _parts(o, state)
    window = state.window
    if window is not None:
        window = _window_specs(o, parts, window)
    return TrainState(
        step=P(),
        params=jax.tree.map(lambda _: P(), state.params),
        opt_state=parts.plan.state_specs(state.opt_state),
        window=window,
        graphdef=state.graphdef,
        model_state=jax.tree.map(lambda _: P(), state.model_state),
        skipped_steps=P(),
        consecutive_skips=P(),
    )


def empty_window(
    o: StepOptions, trainable: Any, batch_stats: Any, dtype: Any, aux: Any = None
) -> Window:
    """A window with nothing added: per-device zero sums (at stage 2 the split leaves'
    global sums, each device its block), the committed statistics' shapes per device;
    ``aux``: the shapes of ``loss_fn``'s aux (:func:`aux_like`)."""
    n = o.num_devices

    def rows(x: Any) -> jax.Array:
        return jnp.zeros((n, *x.shape), dtype)

    grads = jax.tree.map(rows, trainable)
    if o.zero_stage == 2:
        plan = o.plan(trainable)
        leaves = plan.treedef.flatten_up_to(trainable)
        grads = plan.treedef.unflatten(
            [
                rows(x) if d is None else jnp.zeros(x.shape, dtype)
                for x, d in zip(leaves, plan.dims, strict=True)
            ]
        )
    zero = jnp.zeros([], dtype)
    return Window(
        grads=grads,
        loss_sum=jnp.zeros([n], dtype),
        weight=jnp.zeros([n], dtype),
        batch_stats=jax.tree.map(lambda x: jnp.zeros((n, *x.shape), x.dtype), batch_stats),
        position=jnp.zeros([], jnp.int32),
        last=LastUpdate(
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
        forward = _forward(o, params, parts.mask, model_state, step, state.graphdef)
        trainable = to_varying(o)(split_trainable(params, parts.mask))
        aux = forward(trainable, batch, split_state(model_state)[0], 0, jnp.ones([]))[-1]
        return jax.tree.map(lambda x: jnp.asarray(x)[None], aux)

    mapped = mesh_map(o, per_device, (P(), P(), P(), P(o.axis_name)), P(o.axis_name))
    shapes = jax.eval_shape(mapped, state.params, state.model_state, state.step, batch)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), shapes)


def _window_specs(o: StepOptions, parts: _Parts, window: Any) -> Window:
    """Per-device leaves split by their leading axis; at stage 2 the split gradient
    leaves by their plan."""
    rows = P(o.axis_name)
    if o.zero_stage == 2:
        grads = parts.plan.specs(whole=rows)
    else:
        grads = jax.tree.map(lambda _: rows, window.grads)
    return Window(
        grads=grads,
        loss_sum=rows,
        weight=rows,
        batch_stats=jax.tree.map(lambda _: rows, window.batch_stats),
        position=P(),
        last=LastUpdate(P(), P(), P(), P()),
        aux=rows,
    )


def _reduced_specs(parts: _Parts) -> Reduced:
    stats = jax.tree.map(lambda _: P(), parts.batch_stats)
    return Reduced(parts.plan.specs(), P(), P(), stats, P(), P())


def _sums_of(window: Window) -> Sums:
    return Sums(window.grads, window.loss_sum, window.weight, window.batch_stats, window.aux)


def _unblocked(plan: ShardPlan, grads: Any, scattered: bool) -> Any:
    """A device's per-device gradient sums without their leading block axis (a split
    leaf at stage 2 is a block of its own shape)."""
    leaves = plan.treedef.flatten_up_to(grads)
    return plan.treedef.unflatten(
        [x if scattered and d is not None else x[0] for x, d in zip(leaves, plan.dims, strict=True)]
    )


def _forward(o: StepOptions, params, mask, model_state, step, graphdef):
    parts_of_loss = loss_parts(
        o.loss_fn,
        o.loss_reduction,
        graphdef,
        configure=functools.partial(configure, mode=o.batch_stats, axis_name=o.axis_name),
        context=functools.partial(linen_batch_norms, o.batch_stats, o.axis_name),
        with_rng=o.rng_seed is not None,
        has_aux=o.has_aux,
    )
    return micro_forward(
        parts_of_loss,
        params,
        mask,
        model_state,
        step,
        axis_name=o.axis_name,
        rng_seed=o.rng_seed,
    )


def _scatter(o: StepOptions, plan: ShardPlan) -> Callable[[Any], Any]:
    """ZeRO stage 2: each micro-batch's gradients into this device's block of their sum."""
    if o.zero_stage == 2:
        return functools.partial(plan.reduce_scatter, wire=o.comm)
    return _identity


def _identity(x: Any) -> Any:
    return x


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

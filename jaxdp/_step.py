"""The data-parallel train step: :func:`make_train_step` and the :class:`TrainStep` it builds."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._forward import LossReduction, merge_model, split_model
from ._frozen import Trainable, combine, split_trainable
from ._guards import (
    check_loader_batch,
    check_micro_weights,
    check_params,
    check_state_devices,
    is_loader_batch,
)
from ._layout import BatchSizes, call_sizes
from ._mesh import copied, place, place_batch
from ._mesh_map import is_spec
from ._model_kinds import as_trainable
from ._model_state import BatchStats, check_batch_stats, split_state
from ._options import OLD_SPELLINGS, AccumulationPath, Parallel, Skips, StepOptions, fold
from ._pipeline import (
    aux_like,
    empty_window,
    fused_call,
    logical_shapes,
    multisteps_call,
    routes_a_stack,
    state_specs,
)
from ._replicas import check_replicas
from ._shards import slice_to, spec, split_dim
from ._skip_watch import ResizeWatch, SkipWatch
from ._train_state import SkipCounts, TrainState, Window, check_live


class TrainStep:
    """A compiled data-parallel training step; build it with :func:`make_train_step`.

    State in, state out: ``init(params_or_module)`` places a fresh
    :class:`TrainState` on the mesh, and ``step(state, batch)`` returns
    ``(new_state, metrics)``. The ``fused`` path takes a global batch of
    ``num_devices * accum_steps * micro_batch_size`` rows per call and applies
    one update; ``multisteps`` takes one global micro-batch of ``num_devices *
    micro_batch_size`` rows per call and applies an update on every
    ``accum_steps``-th call (``metrics["emitted"]``). On a mesh spanning
    several processes each process passes only its rows of that batch
    (:func:`process_share`); no process holds the whole batch.

    The step keeps no training state between calls. Its host state is two
    watches (jaxdp/_skip_watch.py): ``watch`` (:class:`SkipWatch`), the
    ``max_consecutive_skips`` limit and the bound of two calls in flight on
    several CPU devices, which need the skip counters of recent calls; and the
    micro-batch size of the last call (``ResizeWatch``), so that a multisteps
    window never mixes two sizes and a change is announced once
    (docs/semantics.md, "Errors and guards"). One call runs
    jaxdp/_pipeline.py under ``jax.jit`` (docs/architecture.md).
    """

    def __init__(self, options: StepOptions):
        self.options = options
        skips = options.skips
        self.watch = SkipWatch(
            skips.max_consecutive if skips.nonfinite else None,
            bound=options.num_devices > 1 and options.mesh.devices.flat[0].platform == "cpu",
        )
        self._resize = ResizeWatch(options.path, options.accum_steps)
        donate = (0,) if options.donate else ()
        # One call of the step, read top to bottom: jaxdp/_pipeline.py.
        body = fused_call if options.path == "fused" else multisteps_call
        # One jitted program per set of compiler options, which on GPUs depend on whether
        # the program routes a declared stack (read from the state: the model's metadata
        # may declare it); where they do not, one program, and nothing read per call.
        differ = options.compiler_options(True) != options.compiler_options()
        self._programs = {
            routed: jax.jit(
                functools.partial(body, options),
                donate_argnums=donate,
                compiler_options=options.compiler_options(routed) or None,
            )
            for routed in ((False, True) if differ else (False,))
        }
        self._routes: dict[Any, bool] = {}  # the parameters' structure and shapes -> routed
        self._weights: dict[bytes, jax.Array] = {}
        # The batch's rows: over every device, in the data mesh's order (also under HSDP).
        self._rows = NamedSharding(options.device_mesh, P(options.batch_axes))
        self._ones = np.ones((options.accum_steps,) if options.path == "fused" else (), np.float32)
        self._devices = set(options.mesh.devices.flat)
        self._seen_sharding: Any = None  # the last state sharding found on the mesh's devices

    @property
    def mesh(self) -> Mesh:
        return self.options.mesh

    @property
    def path(self) -> AccumulationPath:
        return self.options.path

    @property
    def accum_steps(self) -> int:
        return self.options.accum_steps

    @property
    def num_devices(self) -> int:
        return self.options.num_devices

    @property
    def process_count(self) -> int:
        """Processes whose devices make up the mesh (1 unless multi-process)."""
        return self.options.process_count

    # ---- state ----------------------------------------------------------------

    def init(self, params_or_module: Any, *, batch: Any = None) -> TrainState:
        """Replicates the model's parameters and builds the optimizer state.

        The model: a parameter pytree, an NNX module, a Flax Linen module bound to
        its variables (``module.bind(variables, rngs=...)``) or an equinox module
        (docs/model-state.md). Checks that every replica holds the same parameters (raises
        :class:`ReplicaMismatchError` naming the first differing leaf), that
        ``batch_stats`` fits the model's BatchNorm modules, and ``trainable``
        its parameters; raises ``TypeError`` naming a leaf that is no array (a
        function, a string: split them off first) or a trainable leaf that is
        not floating-point (freeze it with ``trainable``). The optimizer state
        covers trainable parameters only; at ZeRO stages its leaves of a
        parameter's shape are split over the mesh, and at stage 3 the trainable
        parameters too (``state.params`` holds global arrays, each device its
        block, a leaf no dimension of which the shard count divides padded with
        zeros to a multiple of it, ``state.logical`` its own shape: :meth:`model`
        gives the whole model in its own shapes).

        ``batch``: one call's batch (arrays or ``jax.ShapeDtypeStruct``), needed
        only with ``has_aux=True`` on the multisteps path, whose window holds the
        aux sums: their shapes come from tracing ``loss_fn`` on it (not run).
        """
        o = self.options
        graphdef, params, model_state, mask = self._model_parts(params_or_module)
        # On the mesh the step runs on (HSDP's two axes), as its outputs come back:
        # placed on the data mesh, the second call would compile the step again.
        replicated = NamedSharding(o.device_mesh, P())
        params = place(params, replicated, copy=o.donate)
        model_state = place(model_state, replicated, copy=o.donate)
        check_replicas(params, o.mesh, name="params")

        def counter() -> jax.Array:  # three buffers, each donated once
            return jax.device_put(jnp.zeros([], jnp.int32), replicated)

        state = self._state(graphdef, params, model_state, counter)
        fresh, _, specs = self._fresh_layout(state, mask, batch)
        if o.model_axes and not o.layout.params_split:
            # Each leaf split over the model axes as its metadata says (stage 3 places
            # them so below, with its data split).
            params = jax.device_put(
                params,
                jax.tree.map(
                    lambda s: NamedSharding(o.device_mesh, s), specs.params, is_leaf=is_spec
                ),
            )
            state = state._replace(params=params)
        shardings = jax.tree.map(
            lambda s: NamedSharding(o.device_mesh, s), (specs.opt_state, specs.window)
        )
        opt_state, window = jax.jit(fresh, out_shardings=shardings)(split_trainable(params, mask))
        if o.layout.params_split:  # the trainable leaves split at rest: each device its block
            split = jax.tree.map(
                lambda s: NamedSharding(o.device_mesh, s), specs.params, is_leaf=is_spec
            )
            if specs.logical is None:
                params = jax.device_put(params, split)
            else:  # padded with zeros first: a device_put needs a leaf the devices divide
                plan = o.plan(split_trainable(params, mask))

                def padded(p: Any) -> Any:
                    return combine(plan.pad(split_trainable(p, mask)), p, mask)

                params = jax.jit(padded, out_shardings=split)(params)
            state = state._replace(params=params, logical=specs.logical)
        return state._replace(opt_state=opt_state, window=window)

    def abstract_state(self, params_or_module: Any, *, batch: Any = None) -> TrainState:
        """What :meth:`init` returns, as ``jax.ShapeDtypeStruct`` leaves with the shardings
        the step keeps: nothing is allocated, placed or computed. For :meth:`lower` and
        :meth:`compile` where no state can be made: a model larger than the machine, or
        devices that only compile (a GPU topology described on a CPU machine,
        :func:`jaxdp.testing.gpu_mesh`).

        The model as for :meth:`init`; its arrays may be abstract
        (``nnx.eval_shape(lambda: Model(...))``, ``jax.ShapeDtypeStruct`` leaves). The
        checks are :meth:`init`'s, but the replicas' (which read values).
        """
        o = self.options
        graphdef, params, model_state, mask = self._model_parts(params_or_module, abstract=True)
        shapes = functools.partial(jax.tree.map, lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype))
        counter = functools.partial(jax.ShapeDtypeStruct, (), jnp.int32)
        state = self._state(graphdef, shapes(params), shapes(model_state), counter)
        _, like, specs = self._fresh_layout(state, mask, batch)
        state = like

        def placed(spec: P, x: Any) -> Any:
            if x is None:  # an empty subtree under a spec (no aux)
                return None
            return jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=NamedSharding(o.device_mesh, spec)
                ),
                x,
            )

        return jax.tree.map(placed, specs, state, is_leaf=is_spec)

    def _model_parts(self, params_or_module: Any, *, abstract: bool = False) -> tuple:
        """``(graphdef, params, model_state, trainable mask)`` of the model, checked."""
        o = self.options
        model = as_trainable(params_or_module)
        check_batch_stats(model, o.batch_stats, o.axis_name)
        graphdef, params, model_state = split_model(model)
        if o.batch_stats is not None and graphdef is None:
            raise ValueError("batch_stats needs an NNX module with BatchNorm, got a pytree")
        mask = check_params(params, o.trainable, abstract=abstract)
        if o.layout.state_split and not any(mask):
            raise ValueError(
                f"zero_stage={o.zero_stage} splits the trainable parameters' optimizer "
                f"state over the devices, and params has no trainable leaf "
                f"({len(jax.tree.leaves(params))} leaves in all): use zero_stage=0"
            )
        return graphdef, params, model_state, mask

    def _state(
        self, graphdef: Any, params: Any, model_state: Any, counter: Callable[[], Any]
    ) -> TrainState:
        """A state with no optimizer state or window yet."""
        return TrainState(
            step=counter(),
            params=params,
            opt_state=None,
            window=None,
            graphdef=graphdef,
            model_state=model_state,
            skips=SkipCounts(skipped_steps=counter(), consecutive_skips=counter()),
        )

    def _fresh_layout(
        self, state: TrainState, mask: tuple[bool, ...], batch: Any
    ) -> tuple[Callable[[Any], Any], TrainState, TrainState]:
        """``(fresh, like, specs)``: the function of the trainable parameters (in the
        model's shapes) that makes a fresh optimizer state and window, the state's shapes
        as the step keeps it (stage 3: padded, with its ``logical`` record), and how every
        leaf of it lies on the mesh."""
        o = self.options
        dtype = o.accumulator_dtype(state.params)
        stats = split_state(state.model_state)[0]
        logical = logical_shapes(o, state.params, mask)
        plan = o.plan(split_trainable(state.params, mask))
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.params)
        rest = combine(
            jax.eval_shape(plan.pad, split_trainable(shapes, mask)), shapes, mask
        )  # the parameters as they rest (stage 3's padded leaves)
        resting = state._replace(params=rest, logical=logical)
        aux = None
        if o.has_aux and o.path == "multisteps":
            batch = batch.data if is_loader_batch(batch) else batch
            aux = aux_like(o, resting, None if batch is None else place_batch(batch, self._rows))

        def fresh(trainable: Any) -> tuple[Any, Window | None]:
            return self._fresh(trainable, stats, dtype, aux)

        opt_state, window = jax.eval_shape(fresh, split_trainable(state.params, mask))
        like = resting._replace(opt_state=opt_state, window=window)
        return fresh, like, state_specs(o, like)

    def _fresh(
        self, trainable: Any, batch_stats: Any, dtype: Any, aux: Any
    ) -> tuple[Any, Window | None]:
        """A fresh optimizer state and window (None on the fused path), as the state keeps
        them (stage 3: padded) from the trainable parameters in the model's shapes."""
        o = self.options
        window = None
        if o.path == "multisteps":
            window = empty_window(o, trainable, batch_stats, dtype, aux)
        return o.plan(trainable).pad_state(o.applied_optimizer.init(trainable)), window

    def model(self, state: TrainState) -> Any:
        """The trained model, as given to :meth:`init`: the parameters, or the NNX, bound
        Linen (``.unbind()`` gives ``(module, variables)``) or equinox module. Whole at
        every ZeRO stage, in the model's shapes: at stage 3 its split leaves are global
        arrays (each device holds its block; ``np.asarray`` or ``jax.device_get`` gathers
        them), and a leaf the state holds padded (``state.logical``) comes back sliced to
        its own shape, split along another dimension the shard count divides where one
        does (the first), else replicated.

        The model is yours: its arrays are copies (one device copy of the parameters and
        model state, laid out as the state's), so ``nnx.update`` on it (an EMA, other
        weights for an evaluation) never reaches ``state``, and it stays readable after
        ``state`` is donated to the next call. Raises ``ValueError`` for a ``state``
        that was itself donated already."""
        check_live(state)
        params, model_state = copied((self._unpadded(state), state.model_state))
        return merge_model(state.graphdef, params, model_state)

    def _unpadded(self, state: TrainState) -> Any:
        """``state.params`` with each padded leaf sliced to its logical shape (:meth:`model`)."""
        if state.logical is None:
            return state.params
        o, (leaves, treedef) = self.options, jax.tree.flatten(state.params)
        out = []
        for x, shape in zip(leaves, state.logical.params, strict=True):
            if shape is not None:
                dim = split_dim(shape, o.shards, "first")
                x = _slicer(shape, NamedSharding(o.device_mesh, spec(dim, o.axis_name)))(x)
            out.append(x)
        return treedef.unflatten(out)

    # ---- stepping ---------------------------------------------------------------

    def __call__(
        self, state: TrainState, batch: Any, micro_weights: Any = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """One call: ``(new_state, metrics)``.

        ``micro_weights`` weighs the call's micro-batches (``fused``: one value
        per micro-batch, shape ``[accum_steps]``; ``multisteps``: a scalar);
        default all ones. A micro-batch of weight 0 adds nothing: that is how
        padding fills an incomplete last window (:func:`epoch_schedule`).

        Raises :class:`NonFiniteError` (from ``watch``) before using this
        call's batch once ``max_consecutive_skips`` updates in a row were
        skipped, at most two calls after it happened; ``ValueError`` for a
        ``state`` that was donated to an earlier call, for a micro-batch
        size other than the open multisteps window's, and for ``has_aux``'s aux
        in another structure or shape than the step recorded. The first call with
        another micro-batch size than the call before warns (once per step).
        """
        check_live(state, "state", quick=True)
        sharding = getattr(state.step, "sharding", None)
        if sharding is not self._seen_sharding:  # once per sharding object
            check_state_devices(sharding, self._devices)
            self._seen_sharding = sharding
        if micro_weights is None and is_loader_batch(batch):
            o = self.options
            check_loader_batch(
                batch, path=o.path, num_devices=o.num_devices, accum_steps=o.accum_steps
            )
            batch, micro_weights = batch.data, batch.micro_weights
        sizes, inputs = self._prepare(batch, micro_weights)
        self._resize.before(state, sizes)
        self.watch.before(state)
        state, metrics = self._program(state)(state, *inputs)
        self.watch.after(metrics)
        return state, metrics

    def _program(self, state: TrainState) -> Any:
        """The jitted program for ``state``: the one routing its declared stack, where
        that takes other compiler options (:meth:`StepOptions.compiler_options`)."""
        if len(self._programs) == 1:
            return self._programs[False]
        leaves, structure = jax.tree.flatten(state.params)
        key = (structure, tuple(jnp.shape(x) for x in leaves))  # what the routing reads
        if key not in self._routes:
            self._routes[key] = routes_a_stack(self.options, state)
        return self._programs[self._routes[key]]

    def check(self, state: TrainState) -> None:
        """Raises :class:`NonFiniteError` if ``state`` follows ``max_consecutive_skips``
        skipped updates in a row (``watch.check``: a host read that waits for the
        call that made ``state``). Check the last state after a loop."""
        self.watch.check(state)

    def lower(self, state: Any, batch: Any, micro_weights: Any = None) -> Any:
        """The step lowered for these inputs: arrays, or ``jax.ShapeDtypeStruct`` with
        shardings (nothing is allocated); ``.compile()`` it for :func:`all_reduces`
        or XLA's memory analysis."""
        return self._program(state).lower(state, *self._prepare(batch, micro_weights)[1])

    def trace(self, state: Any, batch: Any, micro_weights: Any = None) -> Any:
        """The step traced for these inputs, as :meth:`lower` takes them: a
        ``jax.stages.Traced``, whose ``.jaxpr`` is the program before XLA (every loop and
        its length; :func:`jaxdp.throughput.step_flops` counts from it)."""
        return self._program(state).trace(state, *self._prepare(batch, micro_weights)[1])

    def compile(self, state: TrainState, batch: Any, micro_weights: Any = None) -> Any:
        """The compiled step for these shapes (for :func:`all_reduces`, memory analysis)."""
        return self.lower(state, batch, micro_weights).compile()

    def sizes(self, batch: Any) -> BatchSizes:
        """The (global) batch identity of a batch for one call of this step; raises
        if it does not fit (:func:`jaxdp._layout.call_sizes`)."""
        return call_sizes(
            batch,
            path=self.path,
            num_devices=self.num_devices,
            accum_steps=self.accum_steps,
            process_count=self.process_count,
        )

    def _prepare(self, batch: Any, micro_weights: Any) -> tuple[BatchSizes, tuple[Any, Any]]:
        """The batch's identity; the batch split over the mesh by rows and the
        micro-batch weights, replicated (abstract inputs stay abstract: a leaf without a
        sharding takes the batch's, and the weights are described, not placed)."""
        shape = (self.accum_steps,) if self.path == "fused" else ()
        sizes = self.sizes(batch)
        if isinstance(micro_weights, jax.ShapeDtypeStruct):
            weights = micro_weights
        elif micro_weights is None:
            weights = self._ones
        else:
            weights = np.asarray(micro_weights, np.float32)  # 0 and 1 are exact
            check_micro_weights(weights)
        if weights.shape != shape:
            raise ValueError(
                f"micro_weights has shape {weights.shape}; the {self.path} path takes "
                f"shape {shape} (one weight per micro-batch of the call)"
            )
        abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(batch))
        if abstract and not isinstance(weights, jax.ShapeDtypeStruct):
            # Nothing is placed for abstract inputs (compile-only devices take no values).
            replicated = NamedSharding(self.mesh, P())
            weights = jax.ShapeDtypeStruct(weights.shape, weights.dtype, sharding=replicated)
        if not isinstance(weights, jax.ShapeDtypeStruct):
            weights = self._placed_weights(weights)
        return sizes, (place_batch(batch, self._rows), weights)

    def _placed_weights(self, weights: np.ndarray) -> jax.Array:
        """The weights on the mesh, placed once per distinct value: a transfer to the
        devices each call cost about as much host time as the rest of the call."""
        key = weights.tobytes()
        placed = self._weights.get(key)
        if placed is None:
            placed = place(weights, NamedSharding(self.mesh, P()))
            if len(self._weights) < 64:  # a schedule has a few patterns (0 marks padding)
                self._weights[key] = placed
        return placed


@functools.cache
def _slicer(shape: tuple[int, ...], sharding: NamedSharding) -> Callable[[Any], Any]:
    """A padded leaf sliced to its logical ``shape``, laid out by ``sharding``: compiled
    once per shape and layout."""
    return jax.jit(functools.partial(slice_to, shape=shape), out_shardings=sharding)


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh,
    accum_steps: int = 1,
    path: AccumulationPath = "fused",
    loss_reduction: LossReduction = "mean",
    has_aux: bool = False,
    batch_stats: BatchStats | None = None,
    trainable: Trainable = None,
    rng_seed: int | None = None,
    accum_dtype: Any = None,
    donate: bool = True,
    parallel: Parallel | None = None,
    skips: Skips | None = None,
    **deprecated: Any,
) -> TrainStep:
    """Builds a data-parallel step with gradient accumulation.

    Args:
      loss_fn: ``loss_fn(params, micro_batch)`` (or ``loss_fn(module, ...)`` when
        :meth:`TrainStep.init` gets an NNX module). Returns the micro-batch's
        mean loss (``loss_reduction="mean"``) or ``(loss_sum, count)``
        (``"weighted"``).
      optimizer: any optax transformation; jaxdp applies it once per step.
      mesh: a one-axis mesh (:func:`data_mesh`); the batch is split over it.
      accum_steps: micro-batches per device per optimizer step.
      path: ``"fused"`` (one call per step, ``lax.scan`` over micro-batches) or
        ``"multisteps"`` (one call per micro-batch; the open window in
        ``state.window``, the all-reduce and the optimizer only on the call that
        ends the window).
      loss_reduction: ``"mean"``: the update follows the mean of the
        ``num_devices * accum_steps`` micro-batch means (DDP with ``loss /
        accum_steps``). ``"weighted"``: it follows ``sum of loss_sum / sum of
        count`` over all micro-batches and devices, exact for unequal counts;
        a negative count makes the update non-finite (refused, never applied).
      has_aux: ``loss_fn`` returns ``(loss, aux)`` (``loss`` as above), ``aux`` a
        pytree of numeric arrays: per-step metrics. ``metrics["aux"]`` holds it
        averaged exactly as the loss: with ``"mean"`` aux is a micro-batch mean
        and the step reports the mean over micro-batches and devices; with
        ``"weighted"`` aux is a micro-batch sum and the step reports the total sum
        divided by the total count (accuracy: the number of correct rows). Its
        sums travel with the gradients' all-reduce, in the accumulator dtype.
        On the multisteps path ``init`` needs a ``batch`` for their shapes. aux
        keeps one structure, and each leaf one shape, for a run: another one
        (a key gained or lost, a leaf that follows the batch size) raises
        ``ValueError`` while the step traces, naming the leaf and both.
      batch_stats: how BatchNorm modules (``nnx.BatchStat`` variables and an
        ``axis_name``) compute statistics; required when the model has any.
        ``"local"``: each device normalizes with its own micro-batch's
        statistics and the running statistics kept are device 0's (DDP with
        ``broadcast_buffers=True``). ``"sync"``: statistics over the
        micro-batch of every device (SyncBatchNorm; jaxdp sets the modules'
        ``axis_name``), at the cost of collectives in every micro-batch's
        forward and backward. Either way the running statistics update once
        per micro-batch.
      trainable: which parameters train (default all): a pytree of bools, a
        predicate ``(path, value) -> bool`` or an NNX filter. Frozen ones get
        no gradient, no all-reduce bytes, no optimizer state and no update.
      rng_seed: if set, ``loss_fn`` is called with the keyword ``rng``, a key
        derived from this seed like the NNX streams' (below).
      accum_dtype: accumulator dtype for gradients, loss and weights; default
        float64 if any parameter is float64, else float32.
      donate: donate the input state's buffers to the output (saves memory;
        the state passed in must not be used again: a call given it again
        raises ``ValueError``).
      parallel: :class:`Parallel`: the ZeRO stage, the gradients' dtype on the
        wire and the mapping strategy (default: stage 0, the accumulator dtype,
        ``shard_map``), the gradient buckets' size on GPUs (``bucket_cap_mb``); at
        stage 3 also HSDP's shard groups (``shards``), when the parameters are
        gathered (``regather``), what the layer loop keeps for the backward
        (``remat``) and in which dtype the parameters travel (``gather_dtype``).
      skips: :class:`Skips`: non-finite updates skipped (default) and the limit
        of them in a row, unused parameters left alone.
      **deprecated: the spellings of jaxdp 0.2 (``strategy``, ``zero_stage``,
        ``comm_dtype``, ``skip_nonfinite``, ``max_consecutive_skips``,
        ``skip_unused``), accepted with a ``DeprecationWarning`` until 0.4.

    Gradients travel once per optimizer step, on the last micro-batch (``no_sync``
    on the others), together with the loss and weight sums and device 0's batch
    statistics: on GPUs in buckets of ``Parallel.bucket_cap_mb`` that XLA runs under
    the rest of that micro-batch's backward, on CPU in one all-reduce (ZeRO stages 1
    and 2: a reduce-scatter, then one all-gather of the parameters; stage 3: the
    parameters gathered for each micro-batch's forward, a layer at a time inside
    :func:`jaxdp.scan_layers`, and the gradients reduce-scattered in its
    backward, nothing gathered after the update; under HSDP these stay within a
    shard group, and one all-reduce across the replica groups follows the last
    micro-batch).

    Randomness: each micro-batch re-keys every ``nnx.Rngs`` stream of the
    module as ``fold_in(fold_in(fold_in(stream_key, step), device),
    micro_batch)`` with ``step`` the updates applied so far, ``device`` the
    global mesh index and ``micro_batch`` the index in the window: masks differ
    across devices and micro-batches and do not depend on how many processes
    share the mesh.
    """
    unknown = sorted(set(deprecated) - set(OLD_SPELLINGS))
    if unknown:
        raise TypeError(f"make_train_step() got an unexpected keyword argument {unknown[0]!r}")
    groups = fold({"parallel": parallel, "skips": skips, **deprecated})
    return TrainStep(
        StepOptions(
            loss_fn=loss_fn,
            optimizer=optimizer,
            mesh=mesh,
            accum_steps=accum_steps,
            path=path,
            loss_reduction=loss_reduction,
            has_aux=has_aux,
            accum_dtype=accum_dtype,
            donate=donate,
            batch_stats=batch_stats,
            rng_seed=rng_seed,
            trainable=trainable,
            parallel=groups.get("parallel") or Parallel(),
            skips=groups.get("skips") or Skips(),
        )
    )

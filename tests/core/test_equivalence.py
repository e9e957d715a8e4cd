"""Every layout trains as one device on the big batch, in float64: the suite's one grid
of this equivalence.

The grid is one product: placement (ZeRO stages 0 to 3, HSDP) x path x num_devices x
accum_steps. What does not change the split or the reduction in kind is a column of its
cell table, each value met where it matters (test_the_grid_meets_every_kind_of_cell):

- the workload, a model and an optimizer: the MLP and the token model (weighted loss,
  the exact global token mean) written as plain pytrees, a stack of residual blocks
  through ``jaxdp.scan_layers`` and the same blocks in a Python loop, the stack as NNX
  modules made with ``nnx.vmap``; an MLP and a scanned stack whose leaves no device or
  shard count divides, which stage 3 and HSDP hold padded (compared in the model's shapes,
  the padding asserted zero); the optimizers that read more than an element (norms
  over the whole tree or per leaf, factored moments, masks by shape, wrappers) on a wider
  MLP whose gradient norms exceed every clip threshold;
- the strategy of stage 0 (``shard_map`` or ``pmap``: how the per-device program is mapped,
  not what it sums);
- the spelling (issue 31, item 5): a CPU mesh takes the step's XLA:CPU spellings
  (jaxdp/_pipeline.py, "XLA:CPU spelling": the multiply by 1 / weight, the ``lax.cond``
  skip, the reset from the sums); ``jaxdp.testing.plain_spelling()`` makes the steps built
  inside take the plain ones every GPU and TPU takes (the divide, the select, fresh zeros);
- HSDP's shard count on 8 devices (2 or 4).

Each cell compares the parameters, the optimizer state and the loss of every step with
plain optax on one device on the big batch. The non-finite skip under both spellings is in
tests/core/test_nonfinite.py; the torch parity cell per ZeRO stage under the plain spelling
is parity_tests/test_parity_zero.py::test_plain_spelling_matches_torch.
"""

import contextlib
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import (
    OPTIMIZERS,
    MegatronMLP,
    big_batch_reference,
    megatron_loss,
    mlp_apply,
    mlp_params,
    mse_loss,
    regression_data,
    train,
    unpadded,
)
from test_stage3 import data as stack_data
from test_stage3 import loss as stack_loss
from test_stage3 import nnx_loss, nnx_net, stacked_params, unscanned_loss

import jaxdp
from jaxdp.testing import TOLERANCES, assert_trees_close, plain_spelling

GLOBAL_BATCH = 32  # divisible by every num_devices * accum_steps below
STEPS = 5
F64 = TOLERANCES["float64"]

# The product.
PLACEMENTS = ("stage_0", "stage_1", "stage_2", "stage_3", "hsdp")
PATHS = ("fused", "multisteps")
# One device, and several: HSDP's replicas x shards 2 x 2 on 4, 4 x 2 and 2 x 4 on 8.
NUM_DEVICES = (1, 4, 8)
ACCUM_STEPS = (1, 4)  # the kinds of K: no micro-batch loop, and a loop (a window of 4 calls)
SPELLINGS = ("cpu", "plain")  # the CPU mesh's own, and every other backend's


def valid(placement, num_devices):
    """HSDP is replicas x shards, each at least 2: 4 or 8 devices here."""
    return placement != "hsdp" or num_devices >= 4


# ---- the workloads: a model, its data and an optimizer --------------------------------


def token_data(rows, seed=3, tokens=6, features=8):
    """Padded token sequences whose lengths (1..tokens) differ a lot."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, tokens, features))
    y = rng.normal(size=(rows, tokens, 3))
    lengths = rng.integers(1, tokens + 1, size=rows)
    mask = (np.arange(tokens)[None, :] < lengths[:, None]).astype(np.float64)
    return x, y, mask


def token_sum_and_count(params, batch):
    x, y, mask = batch
    err = jnp.sum((mlp_apply(params, x) - y) ** 2, axis=-1)
    return jnp.sum(err * mask), jnp.sum(mask)


def token_mean(params, batch):
    total, count = token_sum_and_count(params, batch)
    return total / count


WIDE = (8, 128, 128, 3)  # a 128 x 128 kernel: adafactor factors its second moment from 128


def wide_data(rows):
    x, y = regression_data(rows, sizes=(WIDE[0], WIDE[-1]))
    return x, 30 * y  # gradients with a norm far above every clip threshold


def wide_params():
    rng = np.random.default_rng(0)
    out = {}
    for i, (m, n) in enumerate(zip(WIDE[:-1], WIDE[1:], strict=True)):
        out[f"w{i}"] = rng.normal(size=(m, n)) / np.sqrt(m)
        out[f"b{i}"] = 0.1 * rng.normal(size=n)
    return out


def stack_rows(rows):
    return stack_data(rows=rows)


ODD = (5, 7, 11, 3)  # widths no device or shard count here divides: stage 3 pads them


def odd_params():
    return mlp_params(sizes=ODD)


def odd_data(rows):
    x, y = regression_data(rows, sizes=(ODD[0], ODD[-1]))
    return x, 3 * y  # gradient norms above the clip's threshold on every step


def odd_stack():
    """The stack of width 6: every leaf but the layer axis padded on 4 devices and in
    shard groups of 4, a layer gathered and sliced inside the loop."""
    return stacked_params(width=6)


class Model:
    """``params()`` (a pytree or an NNX module), ``loss_fn`` for the step, its reduction,
    the loss of the big batch the reference descends, the data and whether the layer
    loop goes through ``jaxdp.scan_layers`` (then its stack is declared: ``layers``, as
    ``Parallel.layers`` takes it)."""

    def __init__(self, params, loss_fn, data, *, scanned, weighted=False, reference_loss=None):
        self.params, self.loss_fn, self.data = params, loss_fn, data
        self.scanned, self.weighted = scanned, weighted
        self.layers = ("blocks",) if scanned else None
        self.reference_loss = reference_loss or loss_fn


MODELS = {
    "mlp": Model(mlp_params, mse_loss, regression_data, scanned=False),
    "tokens": Model(
        mlp_params,
        token_sum_and_count,
        token_data,
        scanned=False,
        weighted=True,
        reference_loss=token_mean,
    ),
    "wide_mlp": Model(wide_params, mse_loss, wide_data, scanned=False),
    "stack_scanned": Model(stacked_params, stack_loss, stack_rows, scanned=True),
    # The same function as the scanned stack's (scan_layers outside a step is the loop:
    # test_stage3.py), so the same reference: the scanned stack's.
    "stack_unrolled": Model(stacked_params, unscanned_loss, stack_rows, scanned=False),
    "nnx_vmap_stack": Model(nnx_net, nnx_loss, stack_rows, scanned=True),
    # Leaves that no device count divides, which stage 3 and HSDP pad.
    "odd_mlp": Model(odd_params, mse_loss, odd_data, scanned=False),
    "odd_stack": Model(odd_stack, stack_loss, stack_rows, scanned=True),
    # The MLP with Megatron's tensor-parallel shardings over a "model" axis (issue 49).
    "megatron": Model(MegatronMLP, megatron_loss, regression_data, scanned=False),
}


def by_size(tree):
    return jax.tree.map(lambda x: x.size > 1000, tree)


# name: (optimizer, the largest clip threshold in it: every step's gradient norm exceeds it)
ALL_OPTIMIZERS = {
    **{name: (make, 0) for name, make in OPTIMIZERS.items()},
    # Weight decay under Nesterov momentum, and a clip whose max_norm is below the
    # models' gradient norms (about 1), so that it acts on every step and its norm must
    # be of the whole gradient, not of a device's shard.
    "sgd_nesterov_wd": (
        lambda: optax.chain(
            optax.add_decayed_weights(1e-2), optax.sgd(0.05, momentum=0.9, nesterov=True)
        ),
        0,
    ),
    "adamw_clip": (
        lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=1e-2)),
        0.5,
    ),
    # Optimizers that read more than an element (issue 24, acceptance 2), on the wide MLP.
    "adafactor": (lambda: optax.adafactor(1e-2), 0),
    "lamb": (lambda: optax.lamb(1e-2), 0),
    "lars": (lambda: optax.lars(0.1), 0),
    "adaptive_grad_clip_sgd": (
        lambda: optax.chain(optax.adaptive_grad_clip(0.01), optax.sgd(0.5)),
        0,
    ),
    "chain_clip_0.5": (
        lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1e-2)),
        0.5,
    ),
    "chain_clip_20": (lambda: optax.chain(optax.clip_by_global_norm(20.0), optax.sgd(1e-2)), 20),
    "named_chain_clip": (
        lambda: optax.named_chain(
            ("clip", optax.clip_by_global_norm(1.0)), ("sgd", optax.sgd(1e-2))
        ),
        1.0,
    ),
    "inject_hyperparams_chain_clip_20": (
        lambda: optax.inject_hyperparams(
            lambda lr: optax.chain(optax.clip_by_global_norm(20.0), optax.sgd(lr))
        )(lr=0.05),
        20,
    ),
    "adamw_mask_by_size": (
        lambda: optax.chain(
            optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1, mask=by_size)
        ),
        0.5,
    ),
    "apply_if_finite_adam": (lambda: optax.apply_if_finite(optax.adam(1e-2), 3), 0),
    "multi_transform": (
        lambda: optax.multi_transform(
            {"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2, momentum=0.9)},
            lambda p: {k: "adam" if k.startswith("w") else "sgd" for k in p},
        ),
        0,
    ),
}
WIDE_OPTIMIZERS = sorted(set(ALL_OPTIMIZERS) - set(OPTIMIZERS) - {"sgd_nesterov_wd", "adamw_clip"})

# The workloads each placement takes in turn over its cells (cell j the (j mod len)-th;
# odd lengths, so that a workload meets both paths, and the scanned stack, first, both
# kinds of K, in two cells: its compiles are the dearest). Every placement has scanned and
# unrolled models (the MLP's layers are a Python loop); the stack's loop unrolled differs
# from the MLP's only where the layers are gathered (stage 3, HSDP). The split stages take
# the wide MLP's optimizers (each once over stages 1 and 2) and the decayed weights and
# the clip on the MLP (each at both).
SCANNED = ("stack_scanned", "adamw_clip")
STACKS = [SCANNED, ("stack_unrolled", "adamw_clip")]
SPLIT = [("mlp", "adamw_clip"), ("mlp", "sgd_nesterov_wd")]
WIDE_RUNS = [("wide_mlp", name) for name in WIDE_OPTIMIZERS]
TOKENS = ("tokens", "sgd_momentum")
MLPS = [("mlp", name) for name in ("adamw", "sgd_momentum", "sgd_nesterov_wd", "adamw_clip")]
PADDED = [("odd_mlp", "adamw_clip"), ("odd_stack", "adamw_clip")]
WORKLOADS = {
    "stage_0": [SCANNED, MLPS[0], TOKENS, MLPS[2], ("nnx_vmap_stack", "adamw"), *MLPS[1::2]],
    # The weighted loss 7th: on 4 devices with accumulation.
    "stage_1": [SCANNED, *SPLIT, MLPS[1], *WIDE_RUNS[0:4:2], TOKENS, *WIDE_RUNS[4::2]],
    "stage_2": [SCANNED, *SPLIT, MLPS[0], MLPS[1], WIDE_RUNS[1], TOKENS, *WIDE_RUNS[3::2]],
    # The padded workloads 6th and 7th: on 4 devices at stage 3 (multisteps, fused), on 8
    # in shard groups of 2 and 4 under HSDP (multisteps, fused).
    "stage_3": [*STACKS, ("nnx_vmap_stack", "adamw"), MLPS[1], TOKENS, *PADDED],
    "hsdp": [*STACKS, TOKENS, *MLPS[:2], ("odd_mlp", "sgd_nesterov_wd"), PADDED[1]],
}


def cells():
    """The product, each cell with its columns: (placement, path, num_devices,
    accum_steps, model, optimizer, strategy, spelling, shards).

    The workloads of a placement take its cells in turn. The spelling alternates with
    every axis of the product, so that the two paths of an (N, K) take different
    spellings and each spelling meets every (N, K) of a placement and every (placement,
    path). Stage 0 runs under pmap where N and K's places differ in parity (one device
    with accumulation and the most devices without, 2 devices with it and 4 without), so
    that pmap meets both paths, both spellings and both kinds of N and K. HSDP on 8
    devices splits over 2 or 4, alternating with K.
    """
    out = []
    for si, placement in enumerate(PLACEMENTS):
        mine = [
            (ni, n, ki, k, pi, path)
            for ni, n in enumerate(NUM_DEVICES)
            for ki, k in enumerate(ACCUM_STEPS)
            for pi, path in enumerate(PATHS)
            if valid(placement, n)
        ]
        for j, (ni, n, ki, k, pi, path) in enumerate(mine):
            model, optimizer = WORKLOADS[placement][j % len(WORKLOADS[placement])]
            pmap = placement == "stage_0" and (ni + ki) % 2 == 1
            shards = None
            if placement == "hsdp":
                shards = 2 if n == 4 else (2, 4)[ki]
            out.append(
                (
                    placement,
                    path,
                    n,
                    k,
                    model,
                    optimizer,
                    "pmap" if pmap else "shard_map",
                    SPELLINGS[(si + ni + ki + pi) % 2],
                    shards,
                )
            )
    return out


# Tensor parallelism (issue 49): the model's own split over a "model" axis of 2 beside
# the data axis of N, a (data N, model 2) mesh, the data axis manual and the model axis
# XLA's (HSDP: (replica 2, shard 2, model 2)). Each stage (0 to 3) and HSDP on both paths,
# N of 4 and 2 (HSDP: 4) and K of 1 and 4
# each met by every stage and path, and every (N, K) met; the clip reads the norm of
# leaves split over both axes. And N of 1 on both paths, at stages 0 and 3: tensor
# parallelism alone (jax lowers no manual region for a data axis of one device).
TP_WORKLOAD = ("megatron", "adamw_clip")
TP_CELLS = [  # (placement, path, num_devices, accum_steps)
    ("stage_0", "fused", 4, 4),
    ("stage_0", "multisteps", 2, 1),
    ("stage_1", "fused", 2, 1),
    ("stage_1", "multisteps", 4, 4),
    ("stage_2", "fused", 4, 1),
    ("stage_2", "multisteps", 2, 4),
    ("stage_3", "fused", 2, 4),
    ("stage_3", "multisteps", 4, 1),
    ("hsdp", "fused", 4, 1),
    ("hsdp", "multisteps", 4, 4),
    # One data rank: tensor parallelism alone, the data axis of size 1.
    ("stage_0", "fused", 1, 4),
    ("stage_3", "multisteps", 1, 4),
]


def hsdp(placement):
    """The TP cells' shard groups: 2 data devices each under HSDP, else one group."""
    return 2 if placement == "hsdp" else None


def tp_cells():
    """TP_CELLS with their columns, the spelling alternating so that every stage and
    every path meets both."""
    return [
        (p, path, n, k, *TP_WORKLOAD, "shard_map", SPELLINGS[(i + i // 2) % 2], hsdp(p), 2)
        for i, (p, path, n, k) in enumerate(TP_CELLS)
    ]


GRID = [(*c, 1) for c in cells()] + tp_cells()
COLUMNS = (
    "placement",
    "path",
    "num_devices",
    "accum_steps",
    "model",
    "optimizer",
    "strategy",
    "spelling",
    "shards",
    "model_axis",  # the model axis's size; 1: the one-axis data mesh
)


def made_in(spelling):
    """The context a step of that spelling is made in (the choice is made then)."""
    return plain_spelling() if spelling == "plain" else contextlib.nullcontext()


@functools.cache
def batches(model):
    data = MODELS[model].data(GLOBAL_BATCH * STEPS)
    return [tuple(leaf[i::STEPS] for leaf in data) for i in range(STEPS)]


def reference(model, optimizer):
    """Plain optax on one device, one update per big batch: the parameters, the
    optimizer state and the loss of each step."""
    return references("stack_scanned" if model == "stack_unrolled" else model)[optimizer]


@functools.cache
def references(model):
    """``reference`` of each optimizer the grid gives ``model``, every one updated in one
    program: one compile per model, not per optimizer (18 compiles were a third of the
    grid's CPU seconds)."""
    m = MODELS[model]
    names = sorted({c[5] for c in GRID if c[4] == model or (c[4], model) == PAIRED})
    opts = [ALL_OPTIMIZERS[name][0]() for name in names]
    start = m.params()
    if isinstance(start, nnx.Module):
        graphdef, params, rest = nnx.split(start, nnx.Param, ...)

        def loss(params, batch):
            return m.reference_loss(nnx.merge(graphdef, params, rest), batch)
    else:
        params, loss = jax.tree.map(jnp.asarray, start), m.reference_loss

    @jax.jit
    def update(runs, batch):
        out = []
        for opt, (params, state) in zip(opts, runs, strict=True):
            value, grads = jax.value_and_grad(loss)(params, batch)
            updates, state = opt.update(grads, state, params)
            out.append((optax.apply_updates(params, updates), state, value))
        return out

    runs = [(params, opt.init(params)) for opt in opts]
    losses = []
    for batch in batches(model):
        out = update(runs, batch)
        runs = [(p, state) for p, state, _ in out]
        losses.append([float(value) for _, _, value in out])
    return {
        name: (params, state, [step[i] for step in losses])
        for i, (name, (params, state)) in enumerate(zip(names, runs, strict=True))
    }


# The unrolled stack computes the scanned stack's function: it takes its references.
PAIRED = ("stack_unrolled", "stack_scanned")


def stage_of(placement):
    return 3 if placement == "hsdp" else int(placement[-1])


def make(
    placement, path, num_devices, accum_steps, model, optimizer, strategy, shards, model_axis=1
):
    mesh = jaxdp.data_mesh(num_devices)
    if model_axis > 1:
        auto = (jax.sharding.AxisType.Auto,) * 2
        mesh = jax.make_mesh((num_devices, model_axis), ("data", "model"), axis_types=auto)
    return jaxdp.make_train_step(
        MODELS[model].loss_fn,
        ALL_OPTIMIZERS[optimizer][0](),
        mesh=mesh,
        accum_steps=accum_steps,
        path=path,
        loss_reduction="weighted" if MODELS[model].weighted else "mean",
        parallel=jaxdp.Parallel(
            strategy=strategy,
            zero_stage=stage_of(placement),
            shards=shards,
            layers=MODELS[model].layers,
            model_axes=("model",) if model_axis > 1 else (),
        ),
    )


# One worker runs the grid: the references of a model are computed once per process.
@pytest.mark.xdist_group("equivalence_grid")
@pytest.mark.parametrize(COLUMNS, GRID, ids=["-".join(map(str, cell)) for cell in GRID])
def test_every_layout_trains_as_one_device_on_the_big_batch(
    placement,
    path,
    num_devices,
    accum_steps,
    model,
    optimizer,
    strategy,
    spelling,
    shards,
    model_axis,
):
    with made_in(spelling):
        step = make(
            placement,
            path,
            num_devices,
            accum_steps,
            model,
            optimizer,
            strategy,
            shards,
            model_axis,
        )
    assert step.options.cpu_spelling is (spelling == "cpu")
    with warnings.catch_warnings():
        # Stage 3 without a declared stack gathers every layer at once, and says so
        # (tests/core/test_stage3.py asserts the warning); it computes the same.
        warnings.filterwarnings("ignore", ".*peak memory is not reduced", UserWarning)
        state, history = train(step, MODELS[model].params(), batches(model))
    expected, expected_state, expected_losses = reference(model, optimizer)
    assert int(state.step) == STEPS
    ended = [m for m in history if m.get("emitted", True)]  # the calls that end a window
    assert len(ended) == STEPS and all(m["finite"] for m in ended)
    # The comparison is of a trained model, with every clip acting.
    assert min(float(m["grad_norm"]) for m in ended) > ALL_OPTIMIZERS[optimizer][1]
    assert moved(expected, MODELS[model].params()) > 1e-3
    # The same sums in another order (micro-batches, devices, a reduce-scatter, norms over
    # shards): a few ulps, with the float64 floor for elements near zero where the split
    # stages sum over blocks (stage 0's cells hold to no floor, as they always did); a
    # wrong shard or a norm of one device's shard moves the weights by 1e-3 or more. A
    # leaf stage 3 holds padded is compared in the model's shape, its padding zeros.
    params = unpadded(state.params, expected)
    assert_trees_close(params, expected, atol=None if stage_of(placement) else 0.0)
    # The optimizer state too, leaf by leaf in the same shapes: only where it lies differs.
    assert_trees_close(unpadded(state.opt_state, expected_state), expected_state)
    losses = [float(m["loss"]) for m in ended]
    np.testing.assert_allclose(losses, expected_losses, rtol=F64.rtol)


def moved(params, start):
    """The largest distance of an element of ``params`` from its value in ``start``."""
    if isinstance(start, nnx.Module):
        start = nnx.state(start, nnx.Param)
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(start), strict=True)
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs)


def test_the_grid_meets_every_kind_of_cell():
    """What the grid covers, so that a later edit cannot drop it unseen."""
    every = [dict(zip(COLUMNS, c, strict=True)) for c in GRID]
    table = [c for c in every if c["model_axis"] == 1]  # the product's

    def where(**kw):
        return [c for c in table if all(c[k] == v for k, v in kw.items())]

    def values(name, rows):
        return {c[name] for c in rows}

    # The product, whole: every placement x path x N x K that exists, each once.
    product = {
        (p, path, n, k)
        for p in PLACEMENTS
        for path in PATHS
        for n in NUM_DEVICES
        for k in ACCUM_STEPS
        if valid(p, n)
    }
    assert sorted(
        (c["placement"], c["path"], c["num_devices"], c["accum_steps"]) for c in table
    ) == (sorted(product))
    # Every value of every column, and every workload named.
    assert values("model", table) == set(MODELS) - {TP_WORKLOAD[0]}
    assert values("optimizer", table) == set(ALL_OPTIMIZERS)
    assert {(c["model"], c["optimizer"]) for c in table} == {
        w for ws in WORKLOADS.values() for w in ws
    }
    # Tensor parallelism: stages 0 to 3 and HSDP on both paths each, over data axes of 4
    # and 2 (HSDP: 4 in shard groups of 2), K of 1 and 4 and both spellings (each met by
    # every stage and every path), every (N, K); one data rank on both paths.
    tp = [c for c in every if c["model_axis"] > 1]
    assert {(c["placement"], c["path"]) for c in tp} == {
        (p, path) for p in PLACEMENTS for path in PATHS
    }
    assert values("shards", [c for c in tp if c["placement"] == "hsdp"]) == {2}
    for column in ("placement", "path"):
        for v in values(column, tp):
            mine = [c for c in tp if c[column] == v and c["num_devices"] > 1]
            assert values("num_devices", mine) == ({4} if v == "hsdp" else {2, 4}), v
            assert values("accum_steps", mine) == set(ACCUM_STEPS), v
            assert values("spelling", mine) == set(SPELLINGS), v
    assert {(c["num_devices"], c["accum_steps"]) for c in tp} == {
        (n, k) for n in (2, 4) for k in ACCUM_STEPS
    } | {(1, 4)}
    alone = [c for c in tp if c["num_devices"] == 1]
    assert {(c["placement"], c["path"]) for c in alone} == {
        ("stage_0", "fused"),
        ("stage_3", "multisteps"),
    }
    assert {(c["model"], c["optimizer"]) for c in tp} == {TP_WORKLOAD}
    for p in PLACEMENTS:
        mine = where(placement=p)
        # Scanned and unrolled models at every placement, each on both paths.
        for scanned in (True, False):
            kind = [c for c in mine if MODELS[c["model"]].scanned is scanned]
            assert values("path", kind) == set(PATHS), (p, scanned)
        plain = "stack_unrolled" if p == "hsdp" else "mlp"
        assert values("model", mine) >= {"stack_scanned", "tokens", plain}, p
        assert values("accum_steps", where(placement=p, model="stack_scanned")) == set(
            ACCUM_STEPS
        ), p
        # Each spelling meets every (N, K) of the placement, on both paths.
        for name in SPELLINGS:
            spelled = where(placement=p, spelling=name)
            assert {(c["num_devices"], c["accum_steps"]) for c in spelled} == {
                (c["num_devices"], c["accum_steps"]) for c in mine
            }, (p, name)
            assert values("path", spelled) == set(PATHS), (p, name)
    # Stage 3 and HSDP gather a stack's layers one by one inside the scanned loop and all
    # at once when the loop is Python's; NNX's nnx.vmap stack at stages 0 and 3.
    for p in ("stage_3", "hsdp"):
        assert {"stack_scanned", "stack_unrolled"} <= values("model", where(placement=p)), p
    for p in ("stage_0", "stage_3"):
        assert "nnx_vmap_stack" in values("model", where(placement=p)), p
    # The split stages meet the clip and the decayed weights, each; the wide MLP's
    # optimizers, each at a split stage, meet both split stages and both paths.
    for p in ("stage_1", "stage_2"):
        assert values("optimizer", where(placement=p)) >= {"adamw_clip", "sgd_nesterov_wd"}
    wide = where(model="wide_mlp")
    assert sorted(values("optimizer", wide)) == WIDE_OPTIMIZERS
    assert {(c["placement"], c["path"]) for c in wide} == {
        (p, path) for p in ("stage_1", "stage_2") for path in PATHS
    }
    # pmap (stage 0 only): both paths, both spellings, one device and the most, no
    # accumulation and a loop, the weighted loss and a scanned stack.
    pmap = where(strategy="pmap")
    assert values("placement", pmap) == {"stage_0"}
    assert values("path", pmap) == set(PATHS) and values("spelling", pmap) == set(SPELLINGS)
    assert values("num_devices", pmap) >= {1, 8} and values("accum_steps", pmap) == {1, 4}
    assert {"tokens", "mlp"} <= values("model", pmap)
    assert any(MODELS[c["model"]].scanned for c in pmap)
    assert values("strategy", where(placement="stage_0")) == {"shard_map", "pmap"}
    # The weighted loss: both paths, one device and several, K of both kinds, every
    # placement (above) and both strategies.
    tokens = where(model="tokens")
    for p in PLACEMENTS:  # several devices' counts summed, at every placement
        assert max(values("num_devices", where(placement=p, model="tokens"))) > 1, p
    for p in ("stage_1", "stage_2"):
        assert {(4, 4)} <= {
            (c["num_devices"], c["accum_steps"]) for c in where(placement=p, model="tokens")
        }, p
    assert values("path", tokens) == set(PATHS)
    assert values("num_devices", tokens) >= {1, 8} and values("accum_steps", tokens) == {1, 4}
    assert values("strategy", tokens) == {"shard_map", "pmap"}
    # HSDP on 8 devices: 4 x 2 and 2 x 4.
    assert values("shards", where(placement="hsdp", num_devices=8)) == {2, 4}
    # Leaves padded (stage 3, HSDP): an MLP and a scanned stack, on 4 and 8 devices, both
    # paths, in shard groups of 4 and 2.
    padded = where(model="odd_mlp") + where(model="odd_stack")
    assert values("placement", padded) == {"stage_3", "hsdp"}
    assert values("num_devices", padded) == {4, 8} and values("path", padded) == set(PATHS)
    assert values("shards", where(placement="hsdp", model="odd_mlp")) | values(
        "shards", where(placement="hsdp", model="odd_stack")
    ) == {2, 4}


def conditionals(step, batch):
    state = step.init(mlp_params())
    return len(re.findall(r"\bconditional\(", step.compile(state, batch).as_text()))


def test_the_switch_picks_the_spelling_when_the_step_is_made():
    def make():
        return jaxdp.make_train_step(
            mse_loss, OPTIMIZERS["adamw"](), mesh=jaxdp.data_mesh(2), accum_steps=2
        )

    batch = regression_data(GLOBAL_BATCH)
    with plain_spelling():
        plain = make()
    cpu = make()  # after the block: the CPU mesh's own spelling again
    assert plain.options.cpu_spelling is False and cpu.options.cpu_spelling is True
    # The fused step's one conditional is the CPU spelling's skip (a lax.cond); the plain
    # spelling selects, also when traced after the block has closed.
    assert conditionals(cpu, batch) == 1
    assert conditionals(plain, batch) == 0


# Every (N, K) on both paths, the optimizers alternating: each meets every (N, K) and both
# paths (float32 changes the rounding, not the optimizer's part; 12 cells before, every
# optimizer in every cell).
FLOAT32_GRID = [
    (n, k, sorted(OPTIMIZERS)[(i + pi) % len(OPTIMIZERS)], path)
    for i, (n, k) in enumerate([(1, 4), (2, 2), (8, 4)])
    for pi, path in enumerate(["fused", "multisteps"])
]


@pytest.mark.parametrize(("num_devices", "accum_steps", "optimizer", "path"), FLOAT32_GRID)
def test_float32_within_named_tolerance(num_devices, accum_steps, optimizer, path):
    rows, steps = 64, 5
    x, y = regression_data(rows * steps, dtype=np.float32)
    data = [(x[i::steps], y[i::steps]) for i in range(steps)]
    params = mlp_params(dtype=np.float32)
    expected = big_batch_reference(mse_loss, OPTIMIZERS[optimizer](), params, data)
    step = jaxdp.make_train_step(
        mse_loss,
        OPTIMIZERS[optimizer](),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        path=path,
    )
    state, _ = train(step, params, data)
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(state.params))
    assert_trees_close(state.params, expected)  # float32's named tolerance

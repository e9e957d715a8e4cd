"""``has_aux=True``: metrics from the loss, averaged exactly as the loss is, in the one
all-reduce, on both paths, both strategies and every ZeRO stage (issue 26, item 1)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp.testing import TOLERANCES, assert_trees_close

DEVICES, ACCUM, MICRO = 4, 2, 3  # 24 rows per optimizer step
TOL = {"rtol": TOLERANCES["float64"].rtol, "atol": TOLERANCES["float64"].atol}


def data(steps=2, seed=0):
    rng = np.random.default_rng(seed)
    rows = steps * DEVICES * ACCUM * MICRO
    return rng.normal(size=(rows, 3)), rng.normal(size=(rows,))


def params():
    return {"w": jnp.asarray([0.5, -0.2, 0.1]), "b": jnp.zeros([])}


def errors(p, batch):
    x, y = batch
    return x @ p["w"] + p["b"] - y


def mean_loss(p, batch):
    err = errors(p, batch)
    return jnp.mean(err**2), {"abs": jnp.mean(jnp.abs(err)), "first": err[:2]}


def weighted_loss(p, batch):
    err = errors(p, batch)
    small = (jnp.abs(err) < 1.0).astype(jnp.int32)  # an integer "correct" count
    return (jnp.sum(err**2), err.shape[0]), {"small": jnp.sum(small)}


def make(loss, path="fused", reduction="mean", has_aux=True, **kw):
    return jaxdp.make_train_step(
        loss,
        optax.sgd(0.05),
        mesh=jaxdp.data_mesh(DEVICES),
        accum_steps=ACCUM,
        path=path,
        loss_reduction=reduction,
        has_aux=has_aux,
        **kw,
    )


def run(step, x, y, steps):
    """The metrics of every emitting call, and the final state."""
    rows = DEVICES * ACCUM * MICRO
    calls = [(x[s * rows : (s + 1) * rows], y[s * rows : (s + 1) * rows]) for s in range(steps)]
    if step.path == "multisteps":
        sizes = jaxdp.batch_sizes(num_devices=DEVICES, accum_steps=ACCUM, micro_batch_size=MICRO)
        calls = [m for c in calls for m in jaxdp.micro_batches(c, sizes)]
    state = step.init(params(), batch=calls[0])
    emitted = []
    for call in calls:
        state, metrics = step(state, call)
        if step.path == "fused" or bool(metrics["emitted"]):
            emitted.append(jax.device_get(metrics))
    return state, emitted


def expected_aux(x, y, steps, p_of_step):
    """Per step: the mean over its micro-batches (device-major rows) of each one's aux."""
    rows = DEVICES * ACCUM * MICRO
    out = []
    for s in range(steps):
        xs, ys = x[s * rows : (s + 1) * rows], y[s * rows : (s + 1) * rows]
        micro = [
            mean_loss(p_of_step[s], (xs[i : i + MICRO], ys[i : i + MICRO]))[1]
            for i in range(0, rows, MICRO)
        ]
        out.append(jax.tree.map(lambda *a: np.mean(np.stack(a), axis=0), *micro))
    return out


@pytest.mark.parametrize("path", ["fused", "multisteps"])
@pytest.mark.parametrize(
    ("strategy", "zero_stage"), [("shard_map", 0), ("shard_map", 1), ("shard_map", 2), ("pmap", 0)]
)
def test_aux_is_the_mean_over_micro_batches_and_devices_and_changes_no_update(
    path, strategy, zero_stage
):
    x, y = data()
    parallel = jaxdp.Parallel(zero_stage=zero_stage, strategy=strategy)
    state, emitted = run(make(mean_loss, path, parallel=parallel), x, y, 2)
    plain = make(lambda p, b: mean_loss(p, b)[0], path, has_aux=False, parallel=parallel)
    plain_state, plain_emitted = run(plain, x, y, 2)
    assert_trees_close(state.params, plain_state.params, **TOL)
    # The parameters each step's aux is computed at: before it, by plain SGD on the mean.
    rows = DEVICES * ACCUM * MICRO
    grads = jax.grad(lambda q: mean_loss(q, (x[:rows], y[:rows]))[0])(params())
    before = [params(), jax.tree.map(lambda a, g: a - 0.05 * g, params(), grads)]
    for got, want, plain_metrics in zip(
        emitted, expected_aux(x, y, 2, before), plain_emitted, strict=True
    ):
        assert_trees_close(got["aux"], want, **TOL)
        assert got["loss"] == pytest.approx(plain_metrics["loss"], rel=1e-14)
        assert "aux" not in plain_metrics


def test_weighted_aux_is_the_global_sum_over_the_global_count():
    x, y = data(steps=1)
    emitted = run(make(weighted_loss, reduction="weighted"), x, y, 1)[1]
    plain_loss = make(lambda p, b: weighted_loss(p, b)[0], has_aux=False, reduction="weighted")
    plain = run(plain_loss, x, y, 1)[1]
    small = np.abs(np.asarray(errors(params(), (x, y)))) < 1.0
    assert emitted[0]["aux"]["small"] == pytest.approx(small.mean(), rel=1e-14)
    assert 0 < small.mean() < 1  # the rows differ, so a wrong divisor shows
    assert emitted[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-14)


def test_a_padding_micro_batch_adds_nothing_to_aux_and_waiting_calls_report_the_last():
    x, y = data(steps=1)
    rows = DEVICES * MICRO
    step = make(mean_loss, "multisteps")
    state = step.init(params(), batch=(x[:rows], y[:rows]))
    state, first = step(state, (x[:rows], y[:rows]))
    assert not bool(first["emitted"])
    garbage = (np.full_like(x[:rows], 1e6), y[:rows])
    state, second = step(state, garbage, micro_weights=0.0)
    assert bool(second["emitted"])
    # One micro-batch of weight 1 per device: the mean over the devices' micro-batches.
    starts = range(0, rows, MICRO)
    per_device = [mean_loss(params(), (x[i : i + MICRO], y[i : i + MICRO]))[1] for i in starts]
    want = jax.tree.map(lambda *a: np.mean(np.stack(a), axis=0), *per_device)
    assert_trees_close(jax.device_get(second["aux"]), want, **TOL)
    state, third = step(state, (x[:rows], y[:rows]))  # opens the next window
    assert not bool(third["emitted"])
    assert_trees_close(jax.device_get(third["aux"]), want, **TOL)


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_aux_rides_in_the_one_all_reduce(path):
    x, y = data(steps=1)
    rows = DEVICES * ACCUM * MICRO if path == "fused" else DEVICES * MICRO
    batch = (x[:rows], y[:rows])
    with_aux = make(mean_loss, path)
    without = make(lambda p, b: mean_loss(p, b)[0], path, has_aux=False)
    reduces = jaxdp.testing.all_reduces(
        with_aux.compile(with_aux.init(params(), batch=batch), batch)
    )
    plain = jaxdp.testing.all_reduces(without.compile(without.init(params()), batch))
    assert len(reduces) == len(plain) == 1
    # 3 more float64 values: the mean absolute error and the two first errors.
    assert reduces[0].bytes - plain[0].bytes == 3 * 8


def test_a_tuple_without_has_aux_is_refused_pointing_at_has_aux():
    x, y = data(steps=1)
    step = make(mean_loss, has_aux=False)
    with pytest.raises(TypeError, match=r"\(loss, aux\) with has_aux=True"):
        step(step.init(params()), (x[:24], y[:24]))
    step = make(weighted_loss, reduction="weighted", has_aux=False)
    with pytest.raises(TypeError, match=r"\(\(loss_sum, count\), aux\) without has_aux=True"):
        step(step.init(params()), (x[:24], y[:24]))


def test_bad_aux_and_a_multisteps_init_without_a_batch_are_refused():
    x, y = data(steps=1)
    step = make(lambda p, b: mean_loss(p, b)[0])
    with pytest.raises(TypeError, match=r"with has_aux=True loss_fn must return \(loss, aux\)"):
        step(step.init(params()), (x[:24], y[:24]))
    step = make(lambda p, b: (mean_loss(p, b)[0], {"name": "mse"}))
    with pytest.raises(TypeError, match=r"aux\['name'\] must be a numeric array, got str"):
        step(step.init(params()), (x[:24], y[:24]))
    with pytest.raises(ValueError, match=r"give init\(\.\.\., batch=\.\.\.\) one call's batch"):
        make(mean_loss, "multisteps").init(params())
    with pytest.raises(TypeError, match="has_aux=1 must be True or False"):
        make(mean_loss, has_aux=1)


def test_a_checkpoint_mid_window_keeps_the_aux_sums(tmp_path):
    x, y = data(steps=1)
    rows = DEVICES * MICRO
    micro = [(x[i : i + rows], y[i : i + rows]) for i in (0, rows)]
    step = make(mean_loss, "multisteps")
    sizes = jaxdp.batch_sizes(num_devices=DEVICES, accum_steps=ACCUM, micro_batch_size=MICRO)
    state, _ = step(step.init(params(), batch=micro[0]), micro[0])
    checkpoints = jaxdp.checkpoint.Checkpoints(tmp_path)
    checkpoints.save(state, position=jaxdp.SamplerPosition(0, 0, 1), sizes=sizes, samples=12)
    _, straight = step(state, micro[1])
    restored = checkpoints.restore(step.init(params(), batch=micro[0]), sizes=sizes).state
    _, again = step(restored, micro[1])
    assert bool(again["emitted"])
    np.testing.assert_array_equal(again["aux"]["abs"], straight["aux"]["abs"])
    np.testing.assert_array_equal(again["aux"]["first"], straight["aux"]["first"])


def drifting(change):
    """``mean_loss`` whose aux goes through ``change`` from its second trace on: after the
    record the step keeps (multisteps: ``init``'s trace; fused: the trace for the sums'
    shapes, before the loop over micro-batches)."""
    traces = []

    def loss(p, batch):
        traces.append(None)
        value, aux = mean_loss(p, batch)
        return value, aux if len(traces) == 1 else change(aux)

    return loss


@pytest.mark.parametrize(
    ("path", "accum_steps"), [("fused", ACCUM), ("multisteps", ACCUM), ("multisteps", 1)]
)
@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(
            lambda aux: {**aux, "max": aux["abs"]},
            r"loss_fn's aux changed structure \(added: aux\['max'\]\): this trace returned "
            r"\{aux\['abs'\]: \(\), aux\['first'\]: \(2,\), aux\['max'\]: \(\)\}, the step "
            r"recorded \{aux\['abs'\]: \(\), aux\['first'\]: \(2,\)\}",
            id="a-key-added",
        ),
        pytest.param(
            lambda aux: {"abs": aux["abs"]},
            r"aux changed structure \(missing: aux\['first'\]\)",
            id="a-key-missing",
        ),
        pytest.param(
            # Broadcast into the sums' shape (2,) today: a silent wrong aux, not an error.
            lambda aux: {**aux, "first": aux["first"][:1]},
            r"loss_fn's aux\['first'\] has shape \(1,\) in this trace, where the step "
            r"recorded shape \(2,\)",
            id="a-shape-changed",
        ),
    ],
)
def test_aux_of_another_structure_or_shape_is_refused_while_tracing(
    path, accum_steps, change, message
):
    x, y = data(steps=1)
    rows = DEVICES * MICRO * (accum_steps if path == "fused" else 1)
    batch = (x[:rows], y[:rows])
    step = jaxdp.make_train_step(
        drifting(change),
        optax.sgd(0.05),
        mesh=jaxdp.data_mesh(DEVICES),
        accum_steps=accum_steps,
        path=path,
        has_aux=True,
    )
    state = step.init(params(), batch=batch)
    where = "at init" if path == "multisteps" else "from loss_fn's first trace in this call"
    with pytest.raises(ValueError, match=message) as raised:
        step(state, batch)
    assert where in str(raised.value)
    assert "Return every key on every call (e.g. zeros where a metric is absent)" in str(
        raised.value
    )
    assert int(state.step) == 0  # refused before it ran: the state is whole


def per_row_loss(p, batch):
    """An aux leaf per row: its shape follows the micro-batch size."""
    return mean_loss(p, batch)[0], {"err": errors(p, batch)}


@pytest.mark.parametrize("strategy", ["shard_map", "pmap"])
def test_a_per_row_aux_leaf_names_init_batch_of_another_micro_batch_size(strategy):
    x, y = data(steps=1)
    step = make(per_row_loss, "multisteps", parallel=jaxdp.Parallel(strategy=strategy))
    state = step.init(params(), batch=(x[: DEVICES * MICRO], y[: DEVICES * MICRO]))
    rows = DEVICES * (MICRO + 1)
    with pytest.raises(
        ValueError,
        match=r"aux\['err'\] has shape \(4,\) in this trace, where the step recorded shape "
        r"\(3,\) at init\(\.\.\., batch=\.\.\.\)",
    ):
        step(state, (x[:rows], y[:rows]))

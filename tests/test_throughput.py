"""Throughput built in (issue 43, item 4): FLOPs per optimizer step with the micro-batch
loop counted, rates and MFU, the learning rate of a schedule, metrics in one transfer, and
trackers in a line."""

import io
import struct
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp.throughput import Meter, Progress, Trackers, step_flops

D_IN, HIDDEN, D_OUT = 3, 5, 2


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2)


def setup(accum_steps, path="fused", optimizer=None, num_devices=2, rows=4):
    step = jaxdp.make_train_step(
        loss_fn,
        optimizer or optax.adam(1e-3),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        path=path,
    )
    state = step.init({"w": np.full((D_IN, HIDDEN), 0.1), "v": np.full((HIDDEN, D_OUT), 0.1)})
    calls = accum_steps if path == "fused" else 1
    n = num_devices * calls * rows
    rng = np.random.default_rng(0)
    return step, state, (rng.normal(size=(n, D_IN)), rng.normal(size=(n, D_OUT)))


def closed_form(samples):
    """Matmul FLOPs of forward and backward over ``samples`` rows: x @ w and h @ v forward,
    the gradients of v, h and w backward (none for the data x), 2 per multiply-add."""
    per_row = 2 * (D_IN * HIDDEN + HIDDEN * D_OUT) + 2 * (2 * HIDDEN * D_OUT + D_IN * HIDDEN)
    return per_row * samples


@pytest.mark.parametrize("path", ["fused", "multisteps"])
def test_flops_per_step_count_every_micro_batch(path):
    flops = {}
    for k in (1, 2, 4):
        step, state, batch = setup(k, path)
        flops[k] = step_flops(step, state, batch)
    assert flops[1] * 2 == flops[2] and flops[1] * 4 == flops[4]  # 1 : 2 : 4
    assert flops[4] == closed_form(2 * 4 * 4)  # 2 devices x K = 4 x 4 rows


def test_meter_reads_metrics_and_gives_rates_mfu_and_a_schedules_rate():
    schedule = optax.linear_schedule(0.1, 0.0, transition_steps=10)
    step, state, batch = setup(2, optimizer=optax.adam(schedule))
    meter = Meter(
        step, state, batch, peak_flops_per_device=1e9, tokens_per_sample=7, learning_rate=schedule
    )
    assert (meter.flops, meter.samples) == (closed_form(16), 16)
    logged = []
    for _ in range(3):
        state, metrics = step(state, batch)
        with jax.transfer_guard_device_to_host("disallow"):  # no float() per metric
            values = meter(state, metrics)
        assert values["loss"] == float(metrics["loss"]) and values["step"] == int(state.step)
        exact = {k for k, v in metrics.items() if not jnp.issubdtype(v.dtype, jnp.inexact)}
        integers = {"step", *exact}
        assert all(type(values[k]) is int for k in integers)  # the skip counters, "finite"
        assert all(type(v) is float for k, v in values.items() if k not in integers)
        logged.append(values)
    # The rate of the update just applied, as optax computed it: at its int32 count
    # before the update, step - 1 (float32 from linear_schedule, as optax applied it).
    applied = [float(schedule(jnp.int32(s))) for s in range(3)]
    assert [v["learning_rate"] for v in logged] == applied
    assert "samples_per_s" not in logged[0]  # no interval before the first call
    last = logged[-1]
    assert last["tokens_per_s"] == pytest.approx(7 * last["samples_per_s"])
    assert last["flops_per_s"] == pytest.approx(closed_form(16) / 16 * last["samples_per_s"])
    assert last["mfu"] == pytest.approx(last["flops_per_s"] / (1e9 * 2))


def test_meter_counts_the_tokens_the_loss_weights_not_the_padding():
    """tokens_per_s from the call's count of real items (a device scalar, in the one
    transfer), not samples_per_s * tokens_per_sample, which counts every position."""
    step, state, batch = setup(2)
    meter = Meter(step, state, batch, tokens_per_sample=7)
    real = jnp.sum(jnp.arange(meter.samples * 7) % 7 < 3)  # 3 of each row's 7 are real
    for _ in range(2):
        state, metrics = step(state, batch)
        with jax.transfer_guard_device_to_host("disallow"):
            values = meter(state, metrics, tokens=real)
    assert values["tokens_per_s"] == pytest.approx(3 * values["samples_per_s"])
    assert "tokens" not in values
    with pytest.raises(ValueError, match=r"tokens must be a scalar .* got shape \(2,\)"):
        meter(state, metrics, tokens=jnp.ones(2))


def test_meter_says_once_why_a_plain_schedule_has_no_rate_and_takes_inject_hyperparams():
    step, state, batch = setup(1, optimizer=optax.adam(optax.linear_schedule(0.1, 0.0, 10)))
    meter = Meter(step, state, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            state, metrics = step(state, batch)
            assert "learning_rate" not in meter(state, metrics)
    told = [str(w.message) for w in caught if "learning rate" in str(w.message)]
    assert len(told) == 1 and "inject_hyperparams" in told[0]  # once, with what works
    injected = optax.inject_hyperparams(optax.adam)(learning_rate=0.25)
    step, state, batch = setup(1, optimizer=injected)
    state, metrics = step(state, batch)
    assert Meter(step, state, batch)(state, metrics)["learning_rate"] == 0.25
    with pytest.raises(ValueError, match="peak_flops_per_device=0 must be a number > 0"):
        Meter(step, state, batch, peak_flops_per_device=0)


def test_meter_reports_every_integer_exactly_at_any_size():
    """A float32 holds integers exactly only to 2**24 (float64 to 2**53): the step and
    every integer metric come back as Python ints, bit for bit, in the one transfer."""
    with jax.enable_x64(False):  # jax's default 32-bit types, as a user's script runs
        step, state, batch = setup(1)
        state, metrics = step(state, batch)
        state = state._replace(step=jnp.asarray(2**24 + 1, jnp.int32))
        extra = {"tokens": jnp.int32(2**31 - 1), "bytes": jnp.uint32(2**32 - 1)}
        values = Meter(step, state, batch, learning_rate=1e-3)(state, {**metrics, **extra})
    assert values["step"] == 2**24 + 1 and type(values["step"]) is int  # was 16777216.0
    assert (values["tokens"], values["bytes"]) == (2**31 - 1, 2**32 - 1)
    assert values["loss"] == float(np.float32(metrics["loss"]))
    step, state, batch = setup(1)  # x64 on (tests/conftest.py): 64-bit integers
    state, metrics = step(state, batch)
    extra = {"tokens": jnp.int64(2**53 + 1), "bytes": jnp.uint64(2**64 - 1)}
    values = Meter(step, state, batch, learning_rate=1e-3)(state, {**metrics, **extra})
    assert (values["tokens"], values["bytes"]) == (2**53 + 1, 2**64 - 1)


def test_meter_refuses_a_learning_rate_that_is_not_a_number_or_a_scalar_schedule():
    step, state, batch = setup(1)
    with pytest.raises(TypeError, match=r"learning_rate='cosine' must be a number, an optax"):
        Meter(step, state, batch, learning_rate="cosine")
    with pytest.raises(ValueError, match=r"learning_rate=.* returns shape \(3,\) at a step"):
        Meter(step, state, batch, learning_rate=lambda count: jnp.full(3, 0.1))


def tensorboard_scalars(directory):
    from tensorboardX.proto import event_pb2

    found = {}
    for file in sorted(directory.glob("events.out.tfevents.*")):
        data, at = file.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


def test_trackers_write_tensorboard_and_wandb_in_one_line(tmp_path, monkeypatch):
    runs = []

    class Run:  # the calls the wandb package receives (not installed in the suite)
        def __init__(self, **kwargs):
            self.kwargs, self.logged, self.finished = kwargs, [], False
            runs.append(self)

        def log(self, values, step):
            self.logged.append((step, values))

        def finish(self):
            self.finished = True

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=Run))
    with Trackers(
        ["tensorboard", "wandb"],
        tmp_path,
        project="p",
        config={"lr": 0.1},
        init_kwargs={"wandb": {"mode": "offline"}},
    ) as trackers:
        trackers.log({"loss": 0.5, "mfu": 0.25}, step=1)
        trackers.log({"loss": 0.25}, step=2)
    assert tensorboard_scalars(tmp_path / "p") == {
        "config/text_summary": [(0, 0.0)],  # the config, as text
        "loss": [(1, 0.5), (2, 0.25)],
        "mfu": [(1, 0.25)],
    }
    (run,) = runs
    assert run.kwargs == {
        "project": "p",
        "dir": str(tmp_path),
        "config": {"lr": 0.1},
        "mode": "offline",
    }
    assert run.logged == [(1, {"loss": 0.5, "mfu": 0.25}), (2, {"loss": 0.25})]
    assert run.finished
    with Trackers("tensorboard", tmp_path / "refused") as trackers:
        with pytest.raises(TypeError, match=r"values\['note'\]='warmup' must be a real number"):
            trackers.log({"loss": 0.5, "note": "warmup"}, step=1)
        with pytest.raises(TypeError, match=r"values\['hist'\]=.* must be a real number"):
            trackers.log({"hist": np.zeros(3)}, step=1)
        trackers.log({"n": np.int64(3), "x": jnp.float32(0.5), "b": np.bool_(True)}, step=1)
    assert set(tensorboard_scalars(tmp_path / "refused" / "jaxdp")) == {"n", "x", "b"}
    with pytest.raises(ValueError, match=r"log_with='comet' must name trackers of"):
        Trackers("comet", tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="log_with='wandb' needs wandb: pip install wandb"):
        Trackers("wandb", tmp_path)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_on_a_terminal_only_and_shows_the_meters_values():
    step, state, batch = setup(1)
    meter = Meter(step, state, batch, tokens_per_sample=7)
    terminal, log = _Terminal(), io.StringIO()
    with Progress(3, file=terminal) as bar, Progress(3, file=log) as off:
        assert not bar.disabled and off.disabled  # tqdm's own test: a terminal or not
        for _ in range(3):
            state, metrics = step(state, batch)
            values = meter(state, metrics)
            bar.update(values)
            off.update(values)
        bar.write("epoch 1 done")
    drawn = terminal.getvalue()
    assert "3/3" in drawn and "loss=" in drawn and "tokens_per_s=" in drawn, drawn
    assert "epoch 1 done" in drawn
    assert log.getvalue() == ""  # a log file gets no bar
    with Progress(3, file=io.StringIO(), enabled=True) as told:
        assert not told.disabled  # told to draw, it does
    with pytest.raises(ValueError, match=r"total=0 must be an integer >= 1"):
        Progress(0)

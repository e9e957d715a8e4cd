"""bin/jaxdp bench --quick: well-formed outputs, and the figures that are deterministic.

One quick run (a subprocess: the measurements set their emulated device count
before JAX starts, in processes of their own) feeds every test here, so they
share one xdist worker. Timings are checked for shape only, never against a threshold.
"""

import ast
import json
import pathlib
import re
import subprocess
import sys

import pytest

from benchmarks.harness import _render, gpu
from benchmarks.harness import overhead as overhead_module
from benchmarks.harness import zero as zero_module

ROOT = pathlib.Path(__file__).parent.parent
MEASUREMENTS = ("overhead", "vs_torch", "comms", "memory", "zero")
# Hand-written text around a generated part, which rendering must keep.
HAND_WRITTEN = (
    "# Benchmarks\n\nkept before\n\n<!-- bench:targets -->\nstale\n<!-- /bench:targets -->\n"
    "\nkept after\n"
)

pytestmark = pytest.mark.xdist_group("bench")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    markdown = out / "BENCHMARKS.md"
    markdown.write_text(HAND_WRITTEN)
    command = [sys.executable, "benchmarks/run.py", "--quick", "--out", str(out)]
    command += ["--markdown", str(markdown)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out, markdown, {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_every_measurement_writes_its_json_and_figure(quick):
    out, _, results = quick
    assert set(results) == {*MEASUREMENTS, "run"}
    for name in MEASUREMENTS:
        assert results[name]["quick"] is True
        assert results[name]["wall_seconds"] > 0
        assert results[name]["env"]["versions"]["jax"]
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results["run"]["command"].startswith("bin/jaxdp bench --quick")
    # --quick runs them side by side
    assert results["run"]["wall_seconds"] >= max(results[n]["wall_seconds"] for n in MEASUREMENTS)


def test_quick_runs_the_xla_measurements_in_one_process_and_torch_apart():
    """--quick's smoke run starts JAX once for overhead, comms, memory and zero; vs_torch
    (torch here, XLA in its worker) keeps its own; a real run starts one process each."""
    from benchmarks.harness._runner import CPU_MEASUREMENTS, _processes

    quick = _processes(CPU_MEASUREMENTS, quick=True)
    assert quick == {
        "vs_torch": ["vs_torch", "--quick"],
        "overhead, comms, memory, zero": [
            "_together",
            "overhead",
            "comms",
            "memory",
            "zero",
            "--quick",
        ],
    }
    assert _processes(("memory", "gpu"), quick=True) == {
        "gpu": ["gpu"],
        "memory": ["_together", "memory", "--quick"],
    }
    assert _processes(CPU_MEASUREMENTS, quick=False) == {n: [n] for n in CPU_MEASUREMENTS}


def test_timings_are_well_formed(quick):
    overhead, vs_torch = quick[2]["overhead"], quick[2]["vs_torch"]
    for model in overhead["models"]:
        assert {(r["path"], r["accum_steps"]) for r in model["rows"]} == {
            (path, k) for path in overhead_module.PATHS for k in overhead["accum_steps"]
        }
        for r in model["rows"]:
            assert len(r["seconds"]) == overhead["repeats"] and r["step_seconds"] > 0
            if r["path"] == "hand-written":
                continue  # the floor the others are compared with
            compared = r["compared"]
            assert compared["to"] == overhead_module.BASELINE[r["path"]]
            assert len(compared["ratios"]) == overhead["repeats"]
            assert min(compared["ratios"]) <= compared["ratio"] <= max(compared["ratios"])
            if r["path"] == "multisteps":  # also over the least a K-call design does
                assert r["to_streaming"]["to"] == overhead_module.STREAMING
    modes = [r["mode"] for r in vs_torch["rows"]]
    assert modes == ["accumulation, 1 device", "data parallel, 2 devices (CPU emulation)"]
    for r in vs_torch["rows"]:
        assert r["jaxdp_samples_per_second"] > 0 and r["torch_samples_per_second"] > 0
        assert len(r["jaxdp_seconds"]) == vs_torch["rounds"] or not r["paired"]
        if r["paired"]:  # the same rounds: medians of per-round ratios
            assert r["hand_written_samples_per_second"] > 0
        else:
            assert r["speedup"] == pytest.approx(
                r["jaxdp_samples_per_second"] / r["torch_samples_per_second"]
            )
    parts = {(c["model"], c["part"]) for c in vs_torch["components"]}
    assert parts == {(r["model"], p) for r in vs_torch["rows"] for p in ("micro", "update")}
    for c in vs_torch["components"]:
        assert c["jaxdp_seconds"] > 0 and min(c["torch_seconds_by_threads"].values()) > 0


def test_one_all_reduce_of_the_gradient_bytes_per_step_naive_sends_k_times(quick):
    comms = quick[2]["comms"]
    (model,) = comms["models"]
    assert model["params"] == 16 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4  # the 16-32-32-4 MLP
    grad = model["gradient_bytes"]
    assert grad == 4 * model["params"]  # float32
    for r in model["rows"]:
        k = r["accum_steps"]
        if r["path"] == "naive":
            assert (r["executions_per_step"], r["bytes_per_step"]) == (k, k * grad)
        else:  # fused, multisteps: the loss and weight sums (2 x float32) ride along
            assert (r["executions_per_step"], r["bytes_per_step"]) == (1, grad + 8)
    assert {r["accum_steps"] for r in model["rows"]} == set(comms["accum_steps"])


def test_ring_model_is_the_closed_form(quick):
    comms = quick[2]["comms"]
    assert len(comms["ring"]) == 2 * len(comms["links"]) * len(comms["ring_devices"])
    for r in comms["ring"]:
        n = r["num_devices"]
        assert r["seconds"] == pytest.approx(2 * (n - 1) / n * r["payload_bytes"] / r["bandwidth"])
        assert r["naive_seconds"] == pytest.approx(comms["naive_factor"] * r["seconds"])
    gpt2 = next(r for r in comms["ring"] if r["model"] == "gpt2-small")
    assert gpt2["payload_bytes"] == 4 * 124_439_808


def test_fused_step_memory_against_one_micro_batch(quick):
    memory = quick[2]["memory"]
    (model,) = memory["models"]
    first = model["rows"][0]
    assert first["accum_steps"] == 1 and first["temp_ratio"] == 1.0
    for r in model["rows"]:
        fused, single = r["fused"], r["single_micro_batch"]
        assert r["temp_ratio"] == pytest.approx(fused["temporaries"] / single["temporaries"])
        # No K micro-batches of activations: the loop adds at most the float32
        # accumulator and the micro-batch it slices out, give or take a few percent of
        # loop state and alignment (observed up to 2%), nothing that grows with K.
        bound = 1.05 * (r["accumulator_bytes"] + r["micro_input_bytes"]) + 1024
        assert fused["temporaries"] - single["temporaries"] == r["excess_bytes"] <= bound
        # Same global batch: the arguments differ only by the K micro-batch weights.
        assert fused["arguments"] == first["fused"]["arguments"] + 4 * (r["accum_steps"] - 1)
    for key in ("largest_without_accumulation", "largest_with_accumulation"):
        fit = model[key]
        assert fit["verified"] and 0 < fit["total"] <= memory["budget"]
    with_accum = model["largest_with_accumulation"]
    assert with_accum["global_batch_size"] == (
        memory["num_devices"] * with_accum["micro_batch_size"] * with_accum["accum_steps"]
    )


def test_zero_rows_are_well_formed_and_shard_the_state(quick):
    """Every stage's timing and XLA's per-device bytes: stage 1 holds 1/N of stage 0's
    optimizer state, stage 2 also 1/N of the accumulator, each plus the leaves kept whole."""
    z = quick[2]["zero"]
    n = z["num_devices"]
    (model,) = z["models"]
    rows = {r["variant"]: r for r in model["rows"]}
    assert list(rows) == list(zero_module.VARIANTS)
    for r in rows.values():
        assert (r["zero_stage"], r["comm_dtype"]) == (
            zero_module.VARIANTS[r["variant"]][0],
            zero_module.VARIANTS[r["variant"]][1] or "float32",
        )
        assert len(r["seconds"]) == z["rounds"] and r["step_seconds"] > 0
        c = r["compared"]
        assert c["to"] == "0" and len(c["ratios"]) == z["rounds"]
        assert min(c["ratios"]) <= c["ratio"] <= max(c["ratios"])
        assert r["params_bytes"] == 4 * model["params"]  # float32, whole on every device
        assert r["step"]["total"] >= r["params_bytes"] + r["opt_state_bytes"]
    assert rows["0"]["compared"]["ratios"] == [1.0] * z["rounds"]
    assert set(rows["1"]["target"]) == {"at_most", "met"} and "target" not in rows["2"]
    # Padding: each leaf padded to a multiple of n, in float32 (the MLP has 6 leaves);
    # the scalars (Adam's count; the accumulator's loss and weight sums) a few bytes.
    padding, scalars = 6 * (n - 1) * 4, 64
    full_opt, full_acc = rows["0"]["opt_state_bytes"], rows["0"]["accumulator_bytes"]
    assert full_opt >= 2 * 4 * model["params"] and full_acc >= 4 * model["params"]
    for variant in ("1", "2", "1+bf16"):
        assert rows[variant]["opt_state_bytes"] <= full_opt / n + 2 * padding + scalars
    assert rows["2"]["accumulator_bytes"] <= full_acc / n + padding + scalars
    assert rows["1"]["accumulator_bytes"] == full_acc  # stage 1 keeps the whole sums


def test_markdown_gets_every_table_and_keeps_the_hand_written_text(quick):
    out, markdown, _ = quick
    text = markdown.read_text()
    assert text.startswith("# Benchmarks\n\nkept before\n") and "kept after" in text
    assert "stale" not in text
    for name in _render.SECTIONS:
        assert text.count(f"<!-- bench:{name} -->") == 1
        assert text.count(f"<!-- /bench:{name} -->") == 1
    assert "(overhead.png)" in text and "(zero.png)" in text and "Pending a lent GPU" in text
    # Rendering again from the same results changes nothing.
    _render.render(out, markdown)
    assert markdown.read_text() == text


def test_gpu_script_imports_without_a_gpu_and_counts_gpt2_small(tmp_path):
    import dataclasses

    published = dataclasses.replace(gpu.GPT2_SMALL, vocab_size=50257)
    assert gpu.param_count(published) == 124_439_808
    flops = gpu.flops_per_token(published)
    n = 124_439_808 - 1024 * 768  # without the position embeddings
    assert flops == {"6N": 6 * n, "6N+attention": 6 * n + 12 * 12 * 768 * 1024}
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    model = nnx.eval_shape(lambda: gpu.nnx_model(gpu.TINY, dtype=jnp.bfloat16))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(int(np.prod(p.shape)) for p in params) == gpu.param_count(gpu.TINY)
    assert gpu.main(["--out", str(tmp_path)]) == 2  # no GPU here: it says so and stops
    assert not list(tmp_path.iterdir())


def test_loader_targets_and_section_from_a_result():
    """`bin/jaxdp bench --only loader`'s verdicts and tables (the timings here are made up)."""
    from benchmarks.harness._render_loader import loader_section, loader_targets

    ratios = {"fused": 1.03, "multisteps": 1.08}
    rows = [
        {"path": p, "pre_placed_seconds": 0.01, "step_seconds": 0.01 * r, "ratio": r}
        for p, r in ratios.items()
    ]
    curve = [
        {"workers": n, "step_seconds": 0.01, "ratio": r, "ratios": [r]}
        for n, r in ((1, 1.9), (4, 1.07))
    ]
    result = {
        "num_devices": 4,
        "accum_steps": 2,
        "repeats": 9,
        "models": [{"model": "mlp", "rows": rows}],
        "slow_source": {
            "model": "mlp",
            "delay_per_record_seconds": 2e-5,
            "single_thread_read_seconds": 0.01,
            "pre_placed_seconds": 0.01,
            "rows": curve,
        },
        "memory": [
            {
                "prefetch": 2,
                "workers": 2,
                "placed_batches_alive": 4,
                "placed_bytes": 400,
                "batch_bytes": 100,
                "calls_read": 6,
            }
        ],
    }
    targets = loader_targets(result)
    assert targets[0][1:] == ["worst 1.080 (multisteps)", "**missed** by 3% of the target"]
    assert targets[1][1:] == ["1.070 (workers=4)", "met"]
    section = loader_section(result)
    assert "| mlp | multisteps | 10.00 ms | 10.80 ms | **1.080** |" in section
    assert "| 2 | 2 | 4 | 400 B (4.0 batches) | 6 |" in section


def test_zero3_runs_in_the_full_run_and_when_named_never_in_quick():
    """The suite's --quick run stays as long: stage 3's compiles are the full run's."""
    from benchmarks.harness._runner import CPU_MEASUREMENTS, measurements

    assert measurements(None, quick=True) == CPU_MEASUREMENTS
    assert measurements(None, quick=False) == (*CPU_MEASUREMENTS, "zero3")
    assert measurements(["zero3", "memory", "zero3"], quick=True) == ("zero3", "memory")


def test_zero3_section_from_a_result():
    """`bin/jaxdp bench --only zero3`'s tables (the figures here are made up)."""
    timing = [
        {"variant": v, "accum_steps": k, "step_seconds": s, "compared": {"ratios": rs}}
        for v, k, s, rs in [("2", 1, 0.01, [1.0, 1.0]), ("3", 1, 0.015, [1.4, 1.6])]
    ]
    for r in timing:
        r["compared"]["ratio"] = sorted(r["compared"]["ratios"])[0]
    step = {"arguments": 2_000_000, "temporaries": 1_000_000}
    memory = [
        {
            "variant": "3, window",
            "params_bytes": 500_000,
            "opt_state_bytes": 1_000_000,
            "accumulator_bytes": None,
            "step": step,
            "collectives": {
                "all-gather": {"runs": 1, "ring_bytes": 1.5e6},
                "reduce-scatter": {"runs": 4, "ring_bytes": 6e6},
            },
        }
    ]
    result = {
        "model": {"model": "gpt-scanned", "describe": "d", "params": 10, "micro_batch_size": 16},
        "num_devices": 4,
        "baseline": "2",
        "memory_accum_steps": 4,
        "workers": 4,
        "rounds": 2,
        "samples_per_round": 3,
        "load_average_start": 1.0,
        "env": {"load_average_end": [2.5]},
        "timing": timing,
        "memory": memory,
    }
    section = _render.zero3_section(result)
    assert "| 3 | 1 | 15.00 | **1.400** (1.40-1.60) |" in section
    row = "| 3, window | 0.50 MB | 1.00 MB | - | 2.00 MB | 1.00 MB | **3.00 MB** | 1 / 4 / 0 |"
    assert row + " 7.50 MB |" in section
    assert "3 timing worker process(es)" in section
    assert "Load average (1 min): 1.0 at the start, 2.5 at the end." in section


def test_without_matplotlib_one_line_names_it_before_anything_runs(monkeypatch, capsys, tmp_path):
    from benchmarks.harness import _runner

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert _runner.main(["--quick", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err == "jaxdp bench: error: needs matplotlib (for the figures): pip install matplotlib\n"
    assert not (tmp_path / "out").exists()


def test_the_benchmarks_import_only_public_modules_and_names_of_jaxdp_and_torch_ref():
    """Tools out of the core's way: the benchmarks use jaxdp and torch_ref as a user does
    (names without a leading underscore, from modules without one). One file is the
    exception, by what it is: check_costs.py times jaxdp's private data checks
    themselves (the digest, the NaN scan, the file watch), which no public name runs
    alone; it must still import private names, so the exception cannot go stale."""
    private, timed_internals = [], ROOT / "benchmarks" / "studies" / "check_costs.py"
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                modules, names = [node.module], [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                modules, names = [a.name for a in node.names], []
            else:
                continue
            for module in modules:
                if module.partition(".")[0] not in {"jaxdp", "torch_ref"}:
                    continue
                if any(part.startswith("_") for part in [*module.split("."), *names]):
                    private.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module} {names}")
    exempt = [line for line in private if line.startswith(f"{timed_internals.relative_to(ROOT)}:")]
    assert exempt, "check_costs.py no longer times private checks: drop its exception"
    assert [line for line in private if line not in exempt] == []


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_the_hand_written_floors_make_jaxdps_step(name):
    """The floors the overhead ratios divide by train what jaxdp's fused step trains:
    same mean gradient over devices and micro-batches, same update (2 devices, K=2).
    The bench's AdamW, and SGD, whose update is not blind to a gradient's scale. And
    the hand-written step compiles once for its first call and the ones after."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxdp
    from benchmarks.harness._common import BenchModel, micro_loss, optimizer
    from benchmarks.harness._hand_written import (
        hand_written_step,
        hand_written_streaming,
        replicated,
    )

    if name == "sgd":
        optimizer = lambda: optax.sgd(0.5)  # noqa: E731  (the name the steps below call)
    bm, k, n = BenchModel("mlp", "mlp", {}, 8), 2, 2
    mesh = jaxdp.data_mesh(n)
    rows = NamedSharding(mesh, P(mesh.axis_names[0]))
    module = bm.make()
    loss, params = micro_loss(bm, module)
    # device-major rows: device d's K micro-batches are rows [d*K*m, (d+1)*K*m)
    window = bm.data(n * k * bm.micro_batch_size, seed=3)
    copy = jax.jit(lambda t: jax.tree.map(jax.numpy.copy, t))

    fused = jaxdp.make_train_step(bm.loss, optimizer(), mesh=mesh, accum_steps=k)
    state, _ = fused(fused.init(module), window)

    hand = hand_written_step(loss, optimizer(), mesh, k)
    p0 = copy(params)
    placed = replicated(mesh, (p0, optimizer().init(p0)))
    hand_params, hand_state, _ = hand(*placed, jax.device_put(window, rows))

    accumulate, apply = hand_written_streaming(loss, optimizer(), mesh, k)
    p1 = copy(params)
    sums = jax.tree.map(lambda p: jax.numpy.zeros((n, *p.shape), p.dtype), params)
    sums = jax.device_put(sums, rows)
    by_device = [x.reshape(n, k, -1, *x.shape[1:]) for x in window]
    for i in range(k):  # call i: every device's i-th micro-batch
        micro = tuple(x[:, i].reshape(-1, *x.shape[3:]) for x in by_device)
        sums, _ = accumulate(sums, p1, jax.device_put(micro, rows))
    streamed, _, _ = apply(p1, optimizer().init(p1), sums)

    expected = jax.tree.leaves(state.params)
    for floor in (hand_params, streamed):
        for got, want in zip(jax.tree.leaves(floor), expected, strict=True):
            # float32, one step: sums in another order differ in the last bits;
            # RTOL is a few float32 ulps, ATOL a floor for elements near zero.
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    # From state placed as the step returns it, a second call runs the first call's
    # program (arrays made elsewhere, whose types name no mesh, compiled a second one).
    hand(hand_params, hand_state, jax.device_put(window, rows))
    assert hand._cache_size() == 1


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_profile_script_splits_a_micro_batch_by_kernel(framework):
    """benchmarks/studies/profile_micro.py, the profile BENCHMARKS.md quotes: the kernels'
    times add up to their total, and the matrix products are found among them.

    How much of the total they take is a measurement (BENCHMARKS.md), not checked
    here: on a busy 2-core machine torch's share fell from ~60% to 46% in one CI run."""
    script = ROOT / "benchmarks" / "studies" / "profile_micro.py"
    done = subprocess.run(
        [sys.executable, str(script), framework, "mlp"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    rows = [
        line.split(None, 1)
        for line in lines[lines.index(next(x for x in lines if "all kernels" in x)) :]
    ]
    total, kernels = float(rows[0][0]), {name: float(ms) for ms, name in rows[1:]}
    assert total > 0 and sum(kernels.values()) <= total * (1 + 1e-6)
    assert all(ms >= 0 for ms in kernels.values()), kernels
    products = [name for name, ms in kernels.items() if ms > 0 and re.search(r"mm|dot|ynn", name)]
    assert products, kernels  # the profiler saw the matrix products by name


def test_profile_calls_counts_a_micro_batchs_kernels_in_the_loop_and_in_a_call():
    """benchmarks/studies/profile_calls.py, which BENCHMARKS.md quotes for the streaming floor's
    cost per call: its kernel table reads the loop's body and one call from the trace,
    and the two run the same matrix products per micro-batch (the forward and backward
    are one program text). Its timings are measurements, not checked here."""
    script = ROOT / "benchmarks" / "studies" / "profile_calls.py"
    done = subprocess.run(
        [sys.executable, str(script), "mlp", "2", "--counts-only"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    start = lines.index(next(x for x in lines if x.startswith("kernels per micro-batch"))) + 1
    rows = {}
    for line in lines[start:]:
        loop, rest = line.split("|")
        call, kind = rest.split(None, 1)
        rows[kind] = (float(loop), float(call))
    products = {kind: n for kind, n in rows.items() if re.fullmatch(r"dot|ynn_fusion", kind)}
    assert products and all(loop == call > 0 for loop, call in products.values()), rows

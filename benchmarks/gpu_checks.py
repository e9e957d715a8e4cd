"""Every GPU check of the open issues, as ONE command that runs offline.

For a machine where nothing can be installed and jax (with its CUDA plugin), flax, optax,
orbax-checkpoint and torch are already present: jaxdp comes from this checkout (put on
``PYTHONPATH`` for every step), nothing is pip-installed, and every result lands in one
folder::

    python3 benchmarks/gpu_checks.py --out DIR [--budget-s 540]

Each step runs in a fresh process with its own time limit (a step that fails or runs out
of time is recorded and the next one runs), in this order:

0. ``target_config``: ``benchmarks/studies/gpu_target.py``, the GPU's own target config
   (``DIR/target_config.txtpb``, for ``jaxdp.testing.gpu_mesh(target=PATH)``) and the
   GPT-2-small step compiled on the device beside the same step compiled deviceless with
   that config -> ``DIR/gpu_target.json``;
1. ``bench_gpu``: ``benchmarks/harness/gpu.py`` (what ``bin/jaxdp bench --only gpu`` runs):
   GPT-2 small, bf16, K=8, MFU against the measured bf16 matmul peak, tokens/s against
   ``torch.compile`` (each framework in a process of its own), and jaxdp's multisteps path
   and ZeRO-1 step beside the fused stage-0 step -> ``DIR/gpu.json``;
2. ``parity_fused`` and ``parity_multisteps``: ``jaxdp parity --model transformer --dtype
   float32 --num-devices 1 --torch-device cuda`` at the highest matmul precision (JAX's
   ``highest``; torch_ref turns TF32 off) -> ``DIR/parity.txt``;
3. ``scan_layers``: ``benchmarks/studies/scan_layers.py``, the layer loop's price (scanned
   under a remat that saves nothing, against unrolled without remat), XLA's memory
   analysis against the allocator's peak, the loop structure of the compiled program
   -> ``DIR/scan_layers.json``, ``DIR/scan_layers_scanned.hlo.txt``.

``DIR/gpu_checks.json`` holds each step's command, exit status, seconds and the versions.
Without a GPU it stops at once: "no GPU" and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _probe() -> dict[str, object]:
    """JAX's backend and the versions, from a process of its own: JAX takes most of a GPU's
    memory when its backend starts, so this process never starts it."""
    code = (
        "import importlib.metadata as m, json, jax\n"
        "v = {}\n"
        "for p in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'torch', 'numpy'):\n"
        "    try: v[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: v[p] = None\n"
        "d = jax.devices()[0]\n"
        "print(json.dumps({'backend': jax.default_backend(), 'device': d.device_kind, "
        "'devices': jax.device_count(), 'versions': v, 'python': __import__('sys').version}))\n"
    )
    env = _env(XLA_PYTHON_CLIENT_PREALLOCATE="false")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise SystemExit(f"jaxdp gpu checks: error: JAX did not start:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _steps(out: Path) -> list[tuple[str, list[str], dict[str, str], float, Path | None]]:
    py = sys.executable
    parity = [py, "-m", "jaxdp", "parity", "--model", "transformer", "--dtype", "float32"]
    parity += ["--num-devices", "1", "--torch-device", "cuda", "--steps", "10"]
    precise = {"JAX_DEFAULT_MATMUL_PRECISION": "highest", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    return [
        (
            "target_config",
            [py, str(ROOT / "benchmarks/studies/gpu_target.py"), "--out", str(out)],
            {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
            120.0,
            None,
        ),
        (
            "bench_gpu",
            [py, "-m", "benchmarks.harness.gpu", "--out", str(out), "--variants"],
            {},
            300.0,
            None,
        ),
        ("parity_fused", [*parity, "--path", "fused"], precise, 120.0, out / "parity.txt"),
        (
            "parity_multisteps",
            [*parity, "--path", "multisteps"],
            precise,
            120.0,
            out / "parity.txt",
        ),
        (
            "scan_layers",
            [py, str(ROOT / "benchmarks/studies/scan_layers.py"), "--out", str(out)],
            {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
            240.0,
            None,
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the folder for every result")
    p.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="seconds for all steps together; a step gets at most what is left (default 540)",
    )
    args = p.parse_args(argv)
    started = time.monotonic()
    probe = _probe()
    if probe["backend"] != "gpu":
        print(
            f"jaxdp gpu checks: no GPU (JAX's backend is {probe['backend']!r}, device "
            f"{probe['device']!r}); run this on a machine with a GPU and jax's CUDA plugin"
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    record: dict[str, object] = {"probe": probe, "steps": []}
    summary = args.out / "gpu_checks.json"
    failed = 0
    for name, argv_, extra, limit, log in _steps(args.out):
        left = args.budget_s - (time.monotonic() - started)
        if left < 20:
            record["steps"].append({"name": name, "skipped": f"budget spent ({left:.0f} s left)"})
            failed += 1
            continue
        print(f"== {name}: {' '.join(argv_)}", flush=True)
        t0 = time.monotonic()
        try:
            run = subprocess.run(
                argv_,
                cwd=ROOT,
                env=_env(**extra),
                timeout=min(limit, left),
                capture_output=log is not None,
                text=True,
            )
            status: int | str = run.returncode
            if log is not None:
                with log.open("a") as f:
                    f.write(f"== {name}: {' '.join(argv_[1:])}\n{run.stdout}{run.stderr}\n")
                print(run.stdout[-3000:], run.stderr[-3000:], flush=True)
        except subprocess.TimeoutExpired:
            status = f"timed out after {min(limit, left):.0f} s"
        seconds = time.monotonic() - t0
        failed += status != 0
        record["steps"].append(
            {"name": name, "argv": argv_, "env": extra, "status": status, "seconds": seconds}
        )
        summary.write_text(json.dumps(record, indent=1) + "\n")  # after each step: kept if cut off
        print(f"== {name}: status {status}, {seconds:.0f} s", flush=True)
    record["seconds"] = time.monotonic() - started
    summary.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}: {failed} of {len(record['steps'])} steps failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

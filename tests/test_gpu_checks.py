"""benchmarks/gpu_checks.py, the GPU checks' one command, on a machine without a GPU: it
gets as far as saying so (one line, exit status 2) and writes nothing."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_checks_say_no_gpu_on_a_cpu_machine(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = tmp_path / "results"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu_checks.py"), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout.strip().splitlines() == [
        "jaxdp gpu checks: no GPU (JAX's backend is 'cpu', device 'cpu'); run this on a "
        "machine with a GPU and jax's CUDA plugin"
    ]
    assert not out.exists()

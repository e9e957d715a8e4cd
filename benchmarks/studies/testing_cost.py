"""What ``@pytest.mark.devices(4)`` costs: 20 tests at 4 devices through the plugin, against
the same 20 tests in one pytest process started with 4 devices.

Run from the repository root (about a minute on 2 cores)::

    .venv/bin/python benchmarks/studies/testing_cost.py            # 3 rounds, the median
    .venv/bin/python benchmarks/studies/testing_cost.py --rounds 5

Each test makes an array over the 4 devices and sums it (a compile and a collective). Prints
the wall time of both runs, of a bare JAX start with 4 devices (``python -c``), and how many
JAX starts the difference is. docs/testing.md holds the figures.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = """
import jax
import jax.numpy as jnp
import pytest

MARK = pytest.mark.devices(4) if {marked} else lambda f: f


@MARK
@pytest.mark.parametrize("i", range(20))
def test_sum(i):
    mesh = jax.make_mesh((4,), ("data",))
    x = jax.device_put(jnp.arange(8.0) + i, jax.NamedSharding(mesh, jax.P("data")))
    assert len(jax.devices()) == 4 and float(jnp.sum(x)) == 28 + 8 * i
"""
START = "import jax; jax.config.update('jax_num_cpu_devices', 4); jax.devices()"


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=cwd, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION", "XLA"))}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for marked in (True, False):
            d = root / ("plugin" if marked else "plain")
            d.mkdir()
            (d / "pytest.ini").write_text("[pytest]\n")
            (d / "test_cost.py").write_text(TESTS.format(marked=marked))
        pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        plain_env = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
        times: dict[str, list[float]] = {"plugin": [], "plain": [], "start": []}
        for _ in range(rounds):
            times["plugin"].append(timed(pytest, root / "plugin", env))
            times["plain"].append(timed(pytest, root / "plain", plain_env))
            times["start"].append(timed([sys.executable, "-c", START], root, env))
    plugin, plain, start = (statistics.median(times[k]) for k in ("plugin", "plain", "start"))
    print(f"20 tests at devices(4), through the plugin:   {plugin:5.2f} s")
    print(f"the same in a pytest started with 4 devices:  {plain:5.2f} s")
    print(f"a bare JAX start with 4 devices (python -c):  {start:5.2f} s")
    print(f"difference: {plugin - plain:.2f} s = {(plugin - plain) / start:.2f} JAX starts")


if __name__ == "__main__":
    main()

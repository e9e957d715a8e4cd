"""docs/scaling-out.md's GPU example as written: it compiles a step for 8 H100s on this
CPU machine, and prints the report the page shows (tests/test_docs.py runs the page's
other blocks; this one needs jax's CUDA plugin)."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[2]
PAGE = ROOT / "docs" / "scaling-out.md"


def test_the_gpu_example_prints_what_the_page_shows():
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", PAGE.read_text(), re.M | re.S)
    at = [i for i, (lang, code) in enumerate(blocks) if lang == "python" and "gpu_mesh(" in code]
    assert len(at) == 1 and blocks[at[0] + 1][0] == "text", "no GPU example and its output"
    code, shown = blocks[at[0]][1], blocks[at[0] + 1][1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_ENABLE_X64", None)
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    printed = run.stdout.splitlines()
    assert printed[: len(shown.splitlines())] == shown.splitlines(), run.stdout
    peak = re.fullmatch(r"(\d+) MiB per device at the peak", printed[-1])
    assert peak and 0 < int(peak.group(1)) < 80 * 1024, printed[-1]

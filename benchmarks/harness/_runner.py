"""``bin/jaxdp bench`` (``benchmarks/run.py``): runs the measurements in fresh processes,
then draws and writes the results.

Each measurement runs as ``python -m benchmarks.harness.<name>``: it must set its
own emulated device count before JAX starts, and a fresh process keeps one
measurement's threads, caches and memory from touching the next one's. ``--quick``
(a smoke run, whose timings are not figures) runs the XLA-only ones in one process
(:mod:`._together`), beside vs_torch's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CPU_MEASUREMENTS = ("overhead", "vs_torch", "comms", "memory", "zero")
# The full run's also: zero3 (stage 3 and HSDP), left out of --quick, which the suite runs.
FULL_ONLY = ("zero3",)
# Only when named: gpu needs a GPU; loader (the input pipeline, issue 13) is its own run;
# gpu_programs compiles for GPU topologies on this CPU machine, in the newest-jax
# environment (jax's CUDA plugin: NEWEST).
ALL_MEASUREMENTS = (*CPU_MEASUREMENTS, *FULL_ONLY, "loader", "gpu", "gpu_programs")
NEWEST = ("gpu_programs",)
DEFAULT_OUT = Path("benchmarks/results")
# What --quick runs in one process (._together): XLA alone, no torch, no GPU.
TOGETHER = ("overhead", "comms", "memory", "zero")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bin/jaxdp bench",
        description="Runs jaxdp's benchmarks (each in a fresh process; --quick's XLA-only "
        "ones in one), writes "
        "<out>/<name>.json and PNG figures, and fills the generated tables of the "
        "markdown file (BENCHMARKS.md). The CPU measurements run by default, about "
        "12 minutes on 2 cores; the GPU one only when named (--only gpu). Run from the "
        "repository root.",
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke sizes, for the tests (no figures to trust)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"results directory (default: {DEFAULT_OUT})",
    )
    p.add_argument(
        "--only",
        action="append",
        choices=ALL_MEASUREMENTS,
        default=None,
        metavar="NAME",
        help=f"run only this measurement (repeatable): one of {', '.join(ALL_MEASUREMENTS)} "
        f"(default: {', '.join(CPU_MEASUREMENTS + FULL_ONLY)}; --quick: "
        f"{', '.join(CPU_MEASUREMENTS)})",
    )
    p.add_argument(
        "--markdown",
        type=Path,
        default=Path("BENCHMARKS.md"),
        metavar="FILE",
        help="file whose generated parts are rewritten; created if missing "
        "(default: BENCHMARKS.md)",
    )
    p.add_argument("--no-markdown", action="store_true", help="write JSON and PNG only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``bin/jaxdp bench`` on ``argv`` (default: ``sys.argv[1:]``); the exit status."""
    args = parser().parse_args(argv)
    # The figures need matplotlib: one line before the measurements run, not a
    # traceback after them.
    if importlib.util.find_spec("matplotlib") is None:
        print(
            "jaxdp bench: error: needs matplotlib (for the figures): pip install matplotlib",
            file=sys.stderr,
        )
        return 1
    names = measurements(args.only, quick=args.quick)
    command = "bin/jaxdp bench" + " --quick" * args.quick
    command += "".join(f" --only {name}" for name in args.only or ())
    command += f" --out {args.out}" if args.out != DEFAULT_OUT else ""
    markdown = None if args.no_markdown else args.markdown
    return run(names, out=args.out, quick=args.quick, markdown=markdown, command=command)


def measurements(only: Sequence[str] | None, *, quick: bool) -> tuple[str, ...]:
    """What a run measures: ``only`` (each once, in its order), else the CPU measurements,
    and in a full run (not ``quick``) the full run's own too."""
    if only:
        return tuple(dict.fromkeys(only))
    return CPU_MEASUREMENTS if quick else CPU_MEASUREMENTS + FULL_ONLY


def _env(name: str) -> dict[str, str]:
    env = dict(os.environ)
    # The measurements import the harness and jaxdp of this checkout, whatever is installed.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    if name != "gpu":
        env["JAX_PLATFORMS"] = "cpu"  # the CPU figures, even on a GPU machine
    return env


def _newest_python() -> str:
    """The Python of ``.venv-newest`` (the newest jax and its CUDA plugin), set up by
    ``bin/test-newest-jax --setup-only`` first."""
    root = Path(__file__).resolve().parents[2]
    subprocess.run([str(root / "bin" / "test-newest-jax"), "--setup-only"], check=True)
    return str(root / ".venv-newest" / "bin" / "python")


def _processes(names: tuple[str, ...], *, quick: bool) -> dict[str, list[str]]:
    """The module each process runs and its arguments, by what it measures: one
    ``benchmarks.harness.<name>`` each, but in ``quick`` the XLA-only ones together."""
    together = [name for name in names if quick and name in TOGETHER]
    alone = [name for name in names if name not in together]
    processes = {name: [name] + ["--quick"] * (quick and name != "gpu") for name in alone}
    if together:
        processes[", ".join(together)] = ["_together", *together, "--quick"]
    return processes


def _run_batch(names: tuple[str, ...], *, out: Path, quick: bool) -> int:
    """Starts ``names`` together (see :func:`_processes`); waits for all."""
    running = {}
    for name, (module, *args) in _processes(names, quick=quick).items():
        python = _newest_python() if name in NEWEST else sys.executable
        argv = [python, "-m", f"benchmarks.harness.{module}", *args, "--out", str(out)]
        print(f"jaxdp bench: {name} ...", flush=True)
        running[name] = (subprocess.Popen(argv, env=_env(name)), time.perf_counter())
    status = 0
    for name, (process, t0) in running.items():
        code = process.wait()
        print(f"jaxdp bench: {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
        if code != 0:
            print(f"jaxdp bench: {name} failed (exit status {code})", file=sys.stderr)
            status = status or code
    return status


def run(
    names: tuple[str, ...], *, out: Path, quick: bool, markdown: Path | None, command: str
) -> int:
    """Runs ``names`` one after the other (``quick``: all at once), stops at a failure,
    records the run's command and wall time, and renders figures and tables."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # --quick runs the measurements side by side: its timings are smoke, not figures,
    # and compiling dominates it. A real run runs them one after the other.
    batches = [names] if quick else [(name,) for name in names]
    for batch in batches:
        status = _run_batch(batch, out=out, quick=quick)
        if status != 0:
            return status
    if set(CPU_MEASUREMENTS) <= set(names):  # a full run: its command and wall time
        record: dict[str, Any] = {
            "command": command,
            "quick": quick,
            "wall_seconds": time.perf_counter() - started,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        (out / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    from ._render import render

    render(out, markdown)
    print(f"jaxdp bench: results in {out}" + (f", tables in {markdown}" if markdown else ""))
    return 0

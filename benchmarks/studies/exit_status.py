"""How ``jaxdp train`` exits, over many runs of each way to end a run.

Run from the repository root (about 12 minutes on 2 cores at the default 20 runs)::

    .venv/bin/python benchmarks/studies/exit_status.py            # 20 runs of each way
    .venv/bin/python benchmarks/studies/exit_status.py --runs 5 --ways steps sigterm

Each way has the status a scheduler must see:

- ``steps``: ``--steps 12`` ends inside an epoch (the loader still reading ahead): 0;
- ``epochs``: ``--epochs 2`` ends at the last epoch's last step: 0;
- ``sigterm``: SIGTERM after the third metrics line: a checkpoint, then 143;
- ``resume``: ``--steps 6`` with checkpoints, then ``--resume --steps 12``: 0 (the
  resume's status is counted).

Two runs go at a time, so each run shares the 2 cores as in a busy CI job: the
exit-time abort this counts ("FATAL: exception not rethrown", 134, a loader
thread left inside JAX at interpreter exit) showed in 4 of 8 ``steps`` runs on
a busy machine before the loader's threads were joined at exit. Prints one line
per way and exits 1 if any run ended with another status.
"""

import argparse
import collections
import concurrent.futures
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

JAXDP = [sys.executable, "-m", "jaxdp"]
BASE = ["train", "--cpu-devices", "2", "--no-progress"]
EXPECTED = {"steps": 0, "epochs": 0, "sigterm": 128 + signal.SIGTERM, "resume": 0}


def _status(done: subprocess.CompletedProcess | subprocess.Popen) -> int:
    """The exit status as a shell reports it: 128 + N for a death by signal N."""
    code = done.returncode
    return 128 - code if code < 0 else code


def run_once(way: str, folder: pathlib.Path) -> tuple[int, str]:
    """One run of ``way`` in ``folder``: its exit status and the tail of its stderr."""
    ckpt = ["--checkpoint-dir", str(folder / "ckpt")]
    if way in ("steps", "epochs"):
        flags = ["--steps", "12"] if way == "steps" else ["--epochs", "2"]
        done = subprocess.run([*JAXDP, *BASE, *flags], capture_output=True, text=True)
        return _status(done), done.stderr[-300:]
    if way == "resume":
        first = subprocess.run([*JAXDP, *BASE, *ckpt, "--steps", "6"], capture_output=True)
        if first.returncode != 0:
            return _status(first), "(the run before the resume failed)"
        flags = [*ckpt, "--resume", "--steps", "12"]
        done = subprocess.run([*JAXDP, *BASE, *flags], capture_output=True, text=True)
        return _status(done), done.stderr[-300:]
    metrics = folder / "metrics.jsonl"
    flags = [*ckpt, "--epochs", "1000", "--metrics-out", str(metrics)]
    child = subprocess.Popen(
        [*JAXDP, *BASE, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    while child.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 3:
            child.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    _, err = child.communicate(timeout=300)
    return _status(child), err[-300:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each way (default: 20)")
    parser.add_argument("--ways", nargs="+", choices=list(EXPECTED), default=list(EXPECTED))
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (default: 2)")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with (
        tempfile.TemporaryDirectory() as tmp,
        concurrent.futures.ThreadPoolExecutor(args.parallel) as pool,
    ):
        jobs = {}
        for way in args.ways:
            for i in range(args.runs):
                folder = pathlib.Path(tmp, f"{way}-{i}")
                folder.mkdir()
                jobs[pool.submit(run_once, way, folder)] = way
        results: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        other: dict[str, str] = {}
        for job in concurrent.futures.as_completed(jobs):
            way, (status, err) = jobs[job], job.result()
            results[way][status] += 1
            if status != EXPECTED[way]:
                other.setdefault(way, err)
    bad = False
    for way in args.ways:
        right = results[way][EXPECTED[way]]
        wrong = {s: n for s, n in sorted(results[way].items()) if s != EXPECTED[way]}
        print(
            f"{way:8s} exit {EXPECTED[way]:3d} in {right} of {args.runs}"
            + (f"; other statuses {wrong}: {other[way].strip().splitlines()[-1:]}" if wrong else "")
        )
        bad |= bool(wrong)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

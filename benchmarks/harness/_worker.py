"""Timing workers: one framework per process, timed in turns when the parent says so.

Timing PyTorch and XLA in turns inside ONE process is biased: after torch's
turn its OpenMP threads keep spinning, and an XLA step timed next measured
about 1.3x slower than in a process of its own. So ``vs_torch`` runs jaxdp in
a worker (``python -m benchmarks.harness._worker jaxdp JOBS``) and torch in
itself, a process that runs no XLA computation, and times them in turns: the
one not timed waits meanwhile (the worker on its pipe). A turn that follows
the other framework's starts after a pause (its threads stop spinning), and
every turn with untimed calls that wake the timed framework's threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from ._common import BenchModel, time_calls

MARK = "@@bench "  # the answer lines, among whatever else a worker prints
PAUSE_SECONDS = 0.3  # before a turn: OpenMP threads spin ~0.2 s after their last op
WARMUP_CALLS = 2  # untimed, at the start of every turn


def steppers(framework: str, jobs: list[dict[str, Any]]) -> dict[str, Callable[[], Any]]:
    """Every job's stepper by its key; a job names its model, kind and sizes."""
    built = {}
    for job in jobs:
        bm = BenchModel(**job["model"])
        if framework == "jaxdp":
            from . import _jax_side as side

            sizes = {"num_devices": job["num_devices"], "accum_steps": job["accum_steps"]}
            if job["kind"] == "step":
                fields = ("zero_stage", "comm_dtype", "parallel", "memory")
                zero = {k: job[k] for k in fields if k in job}
                built[job["key"]] = side.jaxdp_stepper(bm, **sizes, **zero)
            elif job["kind"] == "hand-written":
                built[job["key"]] = side.hand_written_stepper(bm, **sizes)
            else:  # "micro" or "update"
                built[job["key"]] = side.component_steppers(bm)[job["kind"]]
        else:
            from . import _torch_side as side

            if job["kind"] == "step":
                built[job["key"]] = side.ga_stepper(bm, job["accum_steps"], job["threads"])
            else:
                built[job["key"]] = side.component_steppers(bm, job["threads"])[job["kind"]]
    for fn in built.values():  # compile, and the first-call costs
        fn()
    return built


class Timer:
    """Times steppers on request: warm-up calls first, and as many calls per sample as
    fill ``sample_seconds``, counted at the first request of each key."""

    def __init__(self, built: dict[str, Callable[[], Any]]):
        self.built, self.calls = built, {}

    def __call__(self, key: str, samples: int, sample_seconds: float) -> dict[str, Any]:
        fn = self.built[key]
        for _ in range(WARMUP_CALLS):
            fn()
        if key not in self.calls:
            once = time_calls(fn, 1)
            self.calls[key] = max(1, round(sample_seconds / max(once, 1e-9)))
        n = self.calls[key]
        return {"seconds": [time_calls(fn, n) for _ in range(samples)], "calls": n}


def serve(framework: str, jobs: list[dict[str, Any]]) -> None:
    """Answers ``{"key", "samples", "sample_seconds"}`` lines with :class:`Timer`'s
    figures, until stdin closes."""
    if framework == "jaxdp":
        from jaxdp import emulate_cpu_devices

        emulate_cpu_devices(max(job["num_devices"] for job in jobs))
    built = steppers(framework, jobs)
    facts = {key: fn.facts for key, fn in built.items() if getattr(fn, "facts", None)}
    timer = Timer(built)
    # What a stepper found while it was built (the zero measurement's memory figures).
    print(MARK + json.dumps({"ready": framework, "facts": facts}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        answer = timer(request["key"], request["samples"], request["sample_seconds"])
        print(MARK + json.dumps(answer), flush=True)


class Worker:
    """The parent's handle on a worker process."""

    local = False

    def __init__(self, framework: str, jobs: list[dict[str, Any]]):
        self.framework = framework
        argv = [sys.executable, "-m", __name__, framework, json.dumps(jobs)]
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ)
        )

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
            sys.stdout.write(line)
        code = self.process.wait()
        raise RuntimeError(f"the {self.framework} timing worker ended (exit status {code})")

    def ready(self) -> dict[str, Any]:
        """Waits until the worker has built its steppers; their ``facts`` by key."""
        return self._answer().get("facts", {})

    def time(self, key: str, *, samples: int, sample_seconds: float, pause: bool) -> dict[str, Any]:
        """``samples`` timed samples of ``key`` after warm-up calls (and a pause first
        if another framework ran just before)."""
        assert self.process.stdin is not None
        if pause:
            time.sleep(PAUSE_SECONDS)
        request = {"key": key, "samples": samples, "sample_seconds": sample_seconds}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


if __name__ == "__main__":
    serve(sys.argv[1], json.loads(sys.argv[2]))


class LocalWorker:
    """The steppers of ``framework`` timed in this process, with :class:`Worker`'s calls.

    For torch in ``vs_torch``: the parent process runs no XLA computation (it
    starts no XLA thread pools), so torch timed in it is timed in a process of
    its own, and one process fewer imports both frameworks. For jaxdp in
    ``zero`` under ``--quick`` (:mod:`._together`), whose process has its devices set.
    """

    local = True

    def __init__(self, framework: str, jobs: list[dict[str, Any]]):
        if framework == "torch":
            import torch

            torch.set_num_threads(max(job["threads"] for job in jobs))
        self.framework, self.jobs, self.timer = framework, jobs, None

    def ready(self) -> dict[str, Any]:
        """Builds the steppers; their ``facts`` by key, as :meth:`Worker.ready`."""
        built = steppers(self.framework, self.jobs)
        self.timer = Timer(built)
        return {key: fn.facts for key, fn in built.items() if getattr(fn, "facts", None)}

    def time(self, key: str, *, samples: int, sample_seconds: float, pause: bool) -> dict[str, Any]:
        if pause:
            time.sleep(PAUSE_SECONDS)
        return self.timer(key, samples, sample_seconds)

    def close(self) -> None:
        self.timer = None

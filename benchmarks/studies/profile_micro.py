"""Where one micro-batch's forward and backward spends its time, by kernel, in one framework.

Run each framework in its own process (never both in one: torch's OpenMP threads
keep spinning after its turn), from the repository root::

    .venv/bin/python benchmarks/studies/profile_micro.py jax gpt     # XLA:CPU, by thunk
    .venv/bin/python benchmarks/studies/profile_micro.py torch gpt   # eager torch, by aten op

``jax``: ``jax.profiler``'s trace of 20 calls of the jitted ``value_and_grad`` of
the bench's micro-batch loss; the time of each XLA thunk, summed by kind (the
thunk's name without its number: ``ynn_fusion`` is a dot fused by XLA's YNNPACK
backend, ``copy_bitcast_fusion`` a transpose written out). ``torch``:
``torch.profiler`` over 20 calls of torch_ref's forward and ``backward`` on 2
threads, self time by aten op. Models: ``gpt`` or ``mlp``, as in ``bin/jaxdp bench``.
"""

import collections
import gzip
import json
import pathlib
import re
import sys
import tempfile

CALLS = 20
# Host-side and scheduling events of the trace, not kernels.
NOT_KERNELS = ("$", "ThunkExecutor", "SlinkyThreadPool", "PjitFunction")


def trace_events(run, calls: int) -> list[dict]:
    """The complete events ("X") of ``jax.profiler``'s trace of ``calls`` runs of ``run``,
    each waited for."""
    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(run())
        (trace,) = pathlib.Path(trace_dir).glob("**/*.trace.json.gz")
        with gzip.open(trace) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    return [e for e in events if e.get("ph") == "X"]


def kernel_kind(name: str) -> str:
    """A thunk's kind: its name without its number (``ynn_fusion.12`` is ``ynn_fusion``)."""
    return re.sub(r"[._]\d+$", "", name)


def profile_jax(bm) -> collections.Counter:
    import jax

    from benchmarks.harness._common import micro_loss

    loss, params = micro_loss(bm, bm.make())
    grad = jax.jit(jax.value_and_grad(loss))
    micro = jax.device_put(bm.data(bm.micro_batch_size))
    for _ in range(5):
        jax.block_until_ready(grad(params, micro))
    by_kind = collections.Counter()
    for e in trace_events(lambda: grad(params, micro), CALLS):
        if not e["name"].startswith(NOT_KERNELS):
            by_kind[kernel_kind(e["name"])] += e.get("dur", 0) / 1e3 / CALLS
    return by_kind


def profile_torch(bm) -> collections.Counter:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.harness._torch_side import component_steppers

    micro = component_steppers(bm, threads=2)["micro"]
    for _ in range(5):
        micro()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(CALLS):
            micro()
    return collections.Counter(
        {e.key: e.self_cpu_time_total / 1e3 / CALLS for e in prof.key_averages()}
    )


def main() -> int:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout
    from benchmarks.harness._common import MODELS

    framework, model = sys.argv[1:3]
    (bm,) = [m for m in MODELS if m.name == model]
    by_kind = profile_jax(bm) if framework == "jax" else profile_torch(bm)
    print(f"{framework}, {bm.describe()}, micro-batch {bm.micro_batch_size}: ms per call")
    print(f"{sum(by_kind.values()):8.2f}  all kernels")
    for name, ms in by_kind.most_common(12):
        print(f"{ms:8.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

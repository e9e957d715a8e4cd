"""What ``K`` calls of one micro-batch cost on XLA:CPU against one loop over ``K`` in one program.

Run from the repository root (about a minute for the GPT)::

    .venv/bin/python benchmarks/studies/profile_calls.py gpt 8     # or: mlp 8
    .venv/bin/python benchmarks/studies/profile_calls.py gpt 8 --counts-only  # kernels, no timing

For the bench's model (``bin/jaxdp bench``'s), the two hand-written floors of
``benchmarks/harness/_hand_written.py``: the fused step (one program, a
``lax.scan`` over ``K`` micro-batches, then the update) and the streaming one
(``K`` calls adding one micro-batch's gradients each, then one applying
them). Prints:

- the kernels per micro-batch, by kind, from ``jax.profiler``'s trace: what
  the fused step over ``2K`` micro-batches runs more than over ``K``, divided
  by ``K`` (the loop's body), and what one accumulating call runs;
- time per optimizer step of both floors, timed in turns, and the streaming
  step's excess per call, ``(streaming - fused) / (K + 1)``, at micro-batches
  of 1 and 4 rows and the bench's size: a fixed cost of launching a program
  would not grow with the micro-batch;
- the same at the bench's size in a child process with XLA's YNNPACK fusions
  off (``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=``; a flag is read
  when XLA starts, so each setting needs its own process).
"""

import collections
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

from profile_micro import kernel_kind, trace_events  # this script's folder is on sys.path

NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="
CONTROL = ("while", "conditional", "call")  # thunks that run others


def _kernels(run, calls: int) -> collections.Counter:
    """XLA's kernels by kind over ``calls`` runs of ``run`` (host-side events left out:
    theirs are CamelCase names or phrases). Counts only: the trace's durations of the
    kernels inside a loop overlap and do not add up."""
    names = [e.get("name", "") for e in trace_events(run, calls)]
    kernels = [n for n in names if re.fullmatch(r"[a-z][\w.-]*", n) and not n.startswith(CONTROL)]
    return collections.Counter(kernel_kind(n) for n in kernels)


def _setup(bm):
    """``(mesh, rows, loss, params, copy)`` for the bench's model ``bm`` on one device."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.harness._common import micro_loss
    from jaxdp import data_mesh

    mesh = data_mesh(1)
    loss, params = micro_loss(bm, bm.make())
    copy = jax.jit(lambda tree: jax.tree.map(jax.numpy.copy, tree))  # the steps donate
    return mesh, NamedSharding(mesh, P(mesh.axis_names[0])), loss, params, copy


def _fused(bm, k: int):
    """One optimizer step of the hand-written fused floor over ``k`` micro-batches."""
    import jax

    from benchmarks.harness._common import optimizer
    from benchmarks.harness._hand_written import hand_written_step, replicated
    from benchmarks.harness.overhead import _chained

    mesh, rows, loss, params, copy = _setup(bm)
    window = jax.device_put(bm.data(k * bm.micro_batch_size), rows)
    step, p = hand_written_step(loss, optimizer(), mesh, k), copy(params)
    return _chained(step, *replicated(mesh, (p, optimizer().init(p))), window, 1)


def _streaming(bm, k: int, *, apply: bool):
    """One optimizer step of the hand-written streaming floor (``k`` accumulating calls,
    one applying), or (``apply=False``) its ``k`` accumulating calls alone."""
    import jax

    from benchmarks.harness._common import optimizer
    from benchmarks.harness._hand_written import hand_written_streaming
    from benchmarks.harness.overhead import _streamed

    mesh, rows, loss, params, copy = _setup(bm)
    micro = jax.device_put(bm.data(bm.micro_batch_size), rows)
    if apply:
        return _streamed(loss, k, mesh, copy(params), micro)
    accumulate, _ = hand_written_streaming(loss, optimizer(), mesh, k)
    zeros = jax.jit(lambda t: jax.tree.map(lambda x: jax.numpy.zeros((1, *x.shape), x.dtype), t))
    sums = [jax.device_put(zeros(params), rows)]

    def accumulating():
        for _ in range(k):
            sums[0], value = accumulate(sums[0], params, micro)
        return value

    return accumulating


def _timing(model: str, k: int, rows: int) -> dict[str, float]:
    """Milliseconds per optimizer step of both floors at ``rows`` rows a micro-batch."""
    from benchmarks.harness._common import MODELS, interleaved, median

    (bm,) = [dataclasses.replace(m, micro_batch_size=rows) for m in MODELS if m.name == model]
    floors = {"fused": _fused(bm, k), "streamed": _streaming(bm, k, apply=True)}
    samples, _ = interleaved(floors, repeats=7, sample_seconds=0.4)
    return {name: median(s) * 1e3 for name, s in samples.items()}


def _report(label: str, k: int, ms: dict[str, float]) -> None:
    per_call = (ms["streamed"] - ms["fused"]) / (k + 1)
    print(
        f"{label}: fused {ms['fused']:.2f} ms, streaming {ms['streamed']:.2f} ms "
        f"({ms['streamed'] / ms['fused']:.3f}x), {per_call:.3f} ms more a call"
    )


def main() -> int:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout
    model, k = sys.argv[1], int(sys.argv[2])
    from benchmarks.harness._common import MODELS

    (bm,) = [m for m in MODELS if m.name == model]
    if "--timing-only" in sys.argv:  # the child with other XLA flags
        print(json.dumps(_timing(model, k, bm.micro_batch_size)))
        return 0
    import jax

    fused, fused_twice = _fused(bm, k), _fused(bm, 2 * k)
    accumulating = _streaming(bm, k, apply=False)
    for run in (fused, accumulating, fused_twice):
        jax.block_until_ready(run())  # compiled before the traces
    # The loop's body: what the fused step over 2k micro-batches runs more than over k.
    loop = _kernels(fused_twice, 2) - _kernels(fused, 2)  # counts above zero only
    call = _kernels(accumulating, 2)
    print(f"{model}, {bm.describe()}, micro-batch {bm.micro_batch_size}, K={k}")
    print("kernels per micro-batch: in the fused step's loop | in one streaming call")
    for kind in sorted(set(loop) | set(call), key=lambda n: (-loop.get(n, 0), n)):
        print(f"{loop[kind] / (2 * k):8.1f} | {call[kind] / (2 * k):8.1f}  {kind}")
    print(f"{loop.total() / (2 * k):8.1f} | {call.total() / (2 * k):8.1f}  all kernels")
    if "--counts-only" in sys.argv:
        return 0
    for rows in sorted({1, 4, bm.micro_batch_size}):
        _report(
            f"micro-batch {rows}, YNNPACK fusions on (XLA's default)", k, _timing(model, k, rows)
        )
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {NO_YNN}".strip())
    child = subprocess.run(
        [sys.executable, __file__, model, str(k), "--timing-only"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    off = json.loads(child.stdout.splitlines()[-1])
    _report(f"micro-batch {bm.micro_batch_size}, YNNPACK fusions off ({NO_YNN})", k, off)
    return 0


if __name__ == "__main__":
    sys.exit(main())

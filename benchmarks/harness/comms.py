"""Communication: all-reduce executions and bytes per optimizer step, and the ring model.

For the fused path, the multisteps path and a deliberately naive step that
all-reduces every micro-batch's gradient (kept here, never in the library),
the compiled programs are read with :func:`jaxdp.testing.all_reduces`: each
all-reduce's payload times how often it runs. The multisteps all-reduce sits
in a conditional branch taken only on the emitting call; which calls emit is
observed by running ``2 K`` calls. The ring model turns payloads into time at
named link bandwidths. Deterministic: no timing.

Run: ``python -m benchmarks.harness.comms --out DIR [--quick]``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ._common import (
    BenchModel,
    bench_models,
    micro_loss,
    optimizer,
    param_bytes,
    split_params,
    standard_args,
)

NUM_DEVICES = 4
ACCUM_STEPS = (1, 2, 4, 8, 16)
QUICK_ACCUM_STEPS = (1, 2)
RING_DEVICES = (8, 64, 512)
# Per-GPU bandwidth in one direction, bytes/s.
LINKS = {
    "NVLink 4 (H100 SXM, 450 GB/s)": 450e9,
    "InfiniBand NDR (400 Gb/s = 50 GB/s)": 50e9,
}
GPT2_SMALL_PARAMS = 124_439_808  # GPT-2 small as published (vocab 50257, tied head)


def naive_step(bm: BenchModel, module: Any, mesh: Any, accum_steps: int) -> Any:
    """A data-parallel step WITHOUT ``no_sync``: one all-reduce per micro-batch.

    The params enter ``shard_map`` replicated and are not marked per-device, so
    JAX treats them as invariant: the gradient of the implicit broadcast is a
    psum, inside the scan body: the trap jaxdp avoids (docs/semantics.md, "Strategies").
    """
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    loss, _ = micro_loss(bm, module)
    axis, opt = mesh.axis_names[0], optimizer()
    scale = 1.0 / (accum_steps * mesh.devices.size)

    def local(params, opt_state, batch):
        micro = jax.tree.map(lambda x: x.reshape(accum_steps, -1, *x.shape[1:]), batch)

        def body(acc, mb):
            grads = jax.grad(loss)(params, mb)  # summed over devices
            return jax.tree.map(jnp.add, acc, grads), None

        grads, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    mapped = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(axis)), out_specs=(P(), P()))
    return jax.jit(mapped)


def _per_call(reduces: list[Any]) -> tuple[int, int, int, int]:
    """All-reduce executions and bytes per call outside conditionals, then the same for
    the conditional branches, counted as if taken (at ``accum_steps=1`` every
    multisteps call emits, and its all-reduce sits in no branch)."""

    def totals(in_conditional: bool) -> tuple[int, int]:
        rs = [r for r in reduces if r.in_conditional == in_conditional]
        return sum(r.executions[1] for r in rs), sum(r.executions[1] * r.bytes for r in rs)

    return (*totals(False), *totals(True))


def measure_model(bm: BenchModel, accum_steps: Sequence[int], mesh: Any) -> dict[str, Any]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdp import make_train_step
    from jaxdp.testing import all_reduces

    module = bm.make()
    n = mesh.devices.size
    by_rows = NamedSharding(mesh, P(mesh.axis_names[0]))
    grad_bytes = param_bytes(split_params(module)[1])  # float32 gradients
    rows = []
    fused_state = None  # one state serves every K: compiling does not consume it
    for k in accum_steps:
        fused = make_train_step(bm.loss, optimizer(), mesh=mesh, accum_steps=k)
        fused_state = fused_state or fused.init(module)
        runs, plain, _, _ = _per_call(all_reduces(fused.compile(fused_state, bm.data(n * k))))
        rows.append(_row("fused", k, runs, plain, grad_bytes))

        multi = make_train_step(bm.loss, optimizer(), mesh=mesh, accum_steps=k, path="multisteps")
        # The call's inputs placed here, as the step places them (rows split over the
        # mesh, the micro-batch weight replicated), so the compiled program takes them.
        micro = jax.device_put(bm.data(n), by_rows)
        weight = jax.device_put(np.float32(1.0), NamedSharding(mesh, P()))
        state = multi.init(module)
        compiled = multi.compile(state, micro, weight)
        runs, plain, branch_runs, branch = _per_call(all_reduces(compiled))
        emitted = 0
        for _ in range(2 * k):  # two optimizer steps; count the calls that emit
            state, metrics = compiled(state, micro, weight)  # the very program inspected
            emitted += bool(metrics["emitted"])
        steps = int(state.step)
        per_step = (2 * k * plain + emitted * branch) / steps
        executions = (2 * k * runs + emitted * branch_runs) / steps
        rows.append(_row("multisteps", k, executions, per_step, grad_bytes))

        naive = naive_step(bm, module, mesh, k)
        _, params, _ = split_params(module)
        params = jax.device_put(params, NamedSharding(mesh, P()))
        batch = jax.device_put(bm.data(n * k), by_rows)
        compiled = naive.lower(params, optimizer().init(params), batch).compile()
        runs, plain, _, _ = _per_call(all_reduces(compiled))
        rows.append(_row("naive", k, runs, plain, grad_bytes))
    return {
        "model": bm.name,
        "describe": bm.describe(),
        "params": grad_bytes // 4,
        "gradient_bytes": grad_bytes,
        "rows": rows,
    }


def _row(path: str, k: int, runs: float, per_step: float, grad_bytes: int) -> dict[str, Any]:
    return {
        "path": path,
        "accum_steps": k,
        "executions_per_step": runs,
        "bytes_per_step": per_step,
        "ratio_to_gradient_bytes": per_step / grad_bytes,
    }


def ring_seconds(payload_bytes: float, num_devices: int, bandwidth: float) -> float:
    """Bandwidth term of a ring all-reduce: ``2 (N - 1) / N * bytes / bandwidth`` (no latency)."""
    from jaxdp.plan import ring_all_reduce_bytes

    return ring_all_reduce_bytes(payload_bytes, num_devices) / bandwidth


def ring_table(payloads: dict[str, int], naive_factor: int) -> list[dict[str, Any]]:
    rows = []
    for model, payload in payloads.items():
        for link, bandwidth in LINKS.items():
            for n in RING_DEVICES:
                seconds = ring_seconds(payload, n, bandwidth)
                rows.append(
                    {
                        "model": model,
                        "link": link,
                        "bandwidth": bandwidth,
                        "num_devices": n,
                        "payload_bytes": payload,
                        "seconds": seconds,
                        "naive_seconds": naive_factor * seconds,
                    }
                )
    return rows


def main(argv: Sequence[str] | None = None, *, shared: bool = False) -> None:
    """``shared``: in :mod:`._together`'s process, whose devices are set (the first
    ``NUM_DEVICES`` are used)."""
    args = standard_args(__doc__.split("\n")[0], argv)
    from jaxdp import data_mesh, emulate_cpu_devices

    if not shared:
        emulate_cpu_devices(NUM_DEVICES)
    started = time.perf_counter()
    ks = QUICK_ACCUM_STEPS if args.quick else ACCUM_STEPS
    mesh = data_mesh(NUM_DEVICES)
    models = [measure_model(bm, ks, mesh) for bm in bench_models(args.quick)]
    payloads = {m["model"]: m["gradient_bytes"] for m in models}
    payloads["gpt2-small"] = 4 * GPT2_SMALL_PARAMS
    from ._common import write_result

    result = {
        "quick": args.quick,
        "num_devices": NUM_DEVICES,
        "accum_steps": list(ks),
        "models": models,
        "ring": ring_table(payloads, naive_factor=max(ks)),
        "naive_factor": max(ks),
        "links": LINKS,
        "ring_devices": list(RING_DEVICES),
    }
    write_result(args.out, "comms", result, started)


if __name__ == "__main__":
    main()

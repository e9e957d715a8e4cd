"""Accumulation overhead: time per optimizer step of both paths against a hand-written step.

The floor is :func:`._hand_written.hand_written_step`: ``shard_map``, a
``lax.scan`` over the micro-batches and one ``pmean``, about 40 lines. jaxdp's
fused path is one call per optimizer step, its multisteps path ``K`` calls; the
least a ``K``-call design does, written by hand
(:func:`._hand_written.hand_written_streaming`: ``K`` calls adding gradients, one
applying them), and a plain ``jax.jit`` of ``optax.MultiSteps`` (``K`` calls)
show what the streaming path costs without jaxdp. All are timed in turns in this
process on one device (accumulation, not emulated communication), batches
already on the device. Also timed, to explain the ratios: one micro-batch's
forward and backward, one optimizer update and one pass ``acc += grads``.

Run: ``python -m benchmarks.harness.overhead --out DIR [--quick]``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ._common import (
    BenchModel,
    bench_models,
    interleaved,
    load_average,
    median,
    micro_loss,
    optimizer,
    standard_args,
)

ACCUM_STEPS = (1, 2, 4, 8, 16)
QUICK_ACCUM_STEPS = (2,)
# What each path is compared with, by name: the floor, and the fused step.
PATHS = ("hand-written", "fused", "hand-written streaming", "multisteps", "optax.MultiSteps")
BASELINE = {path: "fused" for path in PATHS[2:]} | {"fused": "hand-written"}
# Also compared with the hand-written streaming step: what jaxdp's streaming path
# costs over the least a K-call design does.
STREAMING = "hand-written streaming"


def _stepper(step: Any, state: Any, batch: Any, calls: int) -> Callable[[], Any]:
    """One optimizer step: ``calls`` calls of jaxdp's ``step`` (the state chains through)."""
    box = [state]

    def run() -> Any:
        for _ in range(calls):
            box[0], metrics = step(box[0], batch)
        return metrics["loss"]

    return run


def _chained(step: Any, params: Any, opt_state: Any, batch: Any, calls: int) -> Callable[[], Any]:
    """``calls`` calls of ``step(params, opt_state, batch) -> (params, opt_state, loss)``."""
    box = [params, opt_state]

    def run() -> Any:
        for _ in range(calls):
            box[0], box[1], loss = step(box[0], box[1], batch)
        return loss

    return run


def _streamed(loss: Any, k: int, mesh: Any, params: Any, micro: Any) -> Callable[[], Any]:
    """One optimizer step of :func:`._hand_written.hand_written_streaming`: ``k``
    calls adding one micro-batch's gradients each, then one applying them."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ._hand_written import hand_written_streaming, replicated

    accumulate, apply = hand_written_streaming(loss, optimizer(), mesh, k)
    n = mesh.devices.size
    stacked = NamedSharding(mesh, P(mesh.axis_names[0]))
    zeros = jax.jit(
        lambda t: jax.tree.map(lambda p: jnp.zeros((n, *p.shape), p.dtype), t),
        out_shardings=stacked,
    )
    box = [*replicated(mesh, (params, optimizer().init(params))), zeros(params)]

    def run() -> Any:
        for _ in range(k):
            box[2], value = accumulate(box[2], box[0], micro)
        box[0], box[1], box[2] = apply(box[0], box[1], box[2])
        return value

    return run


def _units(bm: BenchModel, module: Any) -> dict[str, Callable[[], Any]]:
    """One micro-batch's forward+backward, one optimizer update and one pass ``acc +=
    grads``, each one jitted call: the units the ratios are explained in."""
    import jax
    import optax

    loss, params = micro_loss(bm, module)
    grad = jax.jit(jax.value_and_grad(loss))
    micro = jax.device_put(bm.data(bm.micro_batch_size))
    _, grads = grad(params, micro)
    opt = optimizer()

    def apply(params, opt_state, grads):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    update = jax.jit(apply, donate_argnums=(0, 1))
    box = [jax.tree.map(jax.numpy.copy, params)]
    box.append(opt.init(box[0]))

    def run_update() -> Any:
        box[0], box[1] = update(box[0], box[1], grads)
        return box[0]

    add = jax.jit(lambda acc, g: jax.tree.map(jax.numpy.add, acc, g), donate_argnums=0)
    acc = [jax.tree.map(jax.numpy.zeros_like, grads)]

    def run_add() -> Any:
        acc[0] = add(acc[0], grads)
        return acc[0]

    return {"micro": lambda: grad(params, micro)[0], "update": run_update, "add": run_add}


def _optax_multisteps(loss: Any, params: Any, k: int) -> Callable[..., Any]:
    """``jax.jit`` of one micro-batch through ``optax.MultiSteps``, as its docs use it."""
    import jax
    import optax

    opt = optax.MultiSteps(optimizer(), k)

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1)), opt.init(params)


def _variants(bm: BenchModel, k: int, mesh: Any, module: Any) -> dict[str, Callable[[], Any]]:
    """The five ways to make one optimizer step over ``k`` micro-batches."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdp import make_train_step

    from ._hand_written import hand_written_step, replicated

    rows = NamedSharding(mesh, P(mesh.axis_names[0]))
    window = jax.device_put(bm.data(k * bm.micro_batch_size), rows)
    micro = jax.device_put(bm.data(bm.micro_batch_size), rows)
    loss, params = micro_loss(bm, module)
    copy = jax.jit(lambda tree: jax.tree.map(jax.numpy.copy, tree))  # the steps donate
    variants = {}
    hand = hand_written_step(loss, optimizer(), mesh, k)
    hand_params = copy(params)
    hand_state = replicated(mesh, (hand_params, optimizer().init(hand_params)))
    variants["hand-written"] = _chained(hand, *hand_state, window, 1)
    for path, batch, calls in (("fused", window, 1), ("multisteps", micro, k)):
        step = make_train_step(bm.loss, optimizer(), mesh=mesh, accum_steps=k, path=path)
        variants[path] = _stepper(step, step.init(module), batch, calls)
    variants[STREAMING] = _streamed(loss, k, mesh, copy(params), micro)
    optax_step, opt_state = _optax_multisteps(loss, copy(params), k)
    optax_state = replicated(mesh, (copy(params), opt_state))
    variants["optax.MultiSteps"] = _chained(optax_step, *optax_state, micro, k)
    return variants


def _ratio(samples: dict[str, list[float]], name: str, baseline: str) -> dict[str, Any]:
    # Per repeat, both were timed within seconds: their ratio is steadier than the
    # ratio of medians on a busy machine.
    ratios = [a / b for a, b in zip(samples[name], samples[baseline], strict=True)]
    return {"to": baseline, "ratio": median(ratios), "ratios": ratios}


def measure_model(
    bm: BenchModel, accum_steps: Sequence[int], *, repeats: int, sample_seconds: float
) -> dict[str, Any]:
    from jaxdp import data_mesh

    mesh = data_mesh(1)
    module = bm.make()
    variants = {f"unit/{name}": fn for name, fn in _units(bm, module).items()}
    for k in accum_steps:
        for path, fn in _variants(bm, k, mesh, module).items():
            variants[f"{path}/{k}"] = fn
    samples, calls = interleaved(variants, repeats=repeats, sample_seconds=sample_seconds)
    rows = []
    for k in accum_steps:
        by_k = {path: samples[f"{path}/{k}"] for path in PATHS}
        for path in PATHS:
            row = {"path": path, "accum_steps": k, "step_seconds": median(by_k[path])}
            row["seconds"] = by_k[path]
            if path in BASELINE:
                row["compared"] = _ratio(by_k, path, BASELINE[path])
            if path == "multisteps":
                row["to_streaming"] = _ratio(by_k, path, STREAMING)
            rows.append(row)
    return {
        "model": bm.name,
        "describe": bm.describe(),
        "micro_batch_size": bm.micro_batch_size,
        "micro_seconds": median(samples["unit/micro"]),
        "update_seconds": median(samples["unit/update"]),
        "accumulate_seconds": median(samples["unit/add"]),
        "calls_per_sample": calls,
        "rows": rows,
    }


def main(argv: Sequence[str] | None = None, *, shared: bool = False) -> None:
    """``shared``: in :mod:`._together`'s process, whose devices are set (one is used)."""
    args = standard_args(__doc__.split("\n")[0], argv)
    from jaxdp import emulate_cpu_devices

    if not shared:
        emulate_cpu_devices(1)
    started = time.perf_counter()
    load_start = load_average()
    ks = QUICK_ACCUM_STEPS if args.quick else ACCUM_STEPS
    repeats, sample_seconds = (2, 0.01) if args.quick else (9, 0.3)
    models = [
        measure_model(bm, ks, repeats=repeats, sample_seconds=sample_seconds)
        for bm in bench_models(args.quick)
    ]
    from ._common import write_result

    result = {
        "quick": args.quick,
        "repeats": repeats,
        "sample_seconds": sample_seconds,
        "accum_steps": list(ks),
        "num_devices": 1,
        "load_average_start": load_start,
        "models": models,
    }
    write_result(args.out, "overhead", result, started)


if __name__ == "__main__":
    main()

"""Accumulation overhead: time per optimizer step of both paths against its floor.

The floor of an optimizer step over ``K`` micro-batches is ``K`` times one
micro-batch's forward and backward (one jitted call) plus one optimizer update
(one jitted call), measured in the same process, in turns with the steps. The
fused path is one call of jaxdp's step; the multisteps path is ``K`` calls.
One device (a 1-device mesh): accumulation, not emulated communication, is
what is measured. Batches are already on the device (data loading excluded).

Run: ``python -m jaxdp.cli.bench.overhead --out DIR [--quick]``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ._common import (
    BenchModel,
    bench_models,
    interleaved,
    median,
    micro_loss,
    optimizer,
    standard_args,
)

ACCUM_STEPS = (1, 2, 4, 8, 16)
QUICK_ACCUM_STEPS = (2,)


def _stepper(step: Any, state: Any, batch: Any, calls: int) -> Callable[[], Any]:
    """One optimizer step: ``calls`` calls of ``step`` (the state chains through)."""
    box = [state]

    def run() -> Any:
        for _ in range(calls):
            box[0], metrics = step(box[0], batch)
        return metrics["loss"]

    return run


def _floor(bm: BenchModel, module: Any) -> dict[str, Callable[[], Any]]:
    """One micro-batch's forward+backward, and one optimizer update, each one jitted call.

    Also one pass ``acc += grads`` over the gradients (not part of the floor):
    the unit of the memory-bound work accumulation adds, to explain the ratios.
    """
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


def measure_model(
    bm: BenchModel, accum_steps: Sequence[int], *, repeats: int, sample_seconds: float
) -> dict[str, Any]:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..._mesh import data_mesh
    from ..._step import make_train_step

    mesh = data_mesh(1)
    spec = bm.spec()
    module = spec.make()
    sharding = NamedSharding(mesh, P(mesh.axis_names[0]))
    variants = {f"floor/{k}": fn for k, fn in _floor(bm, module).items()}
    for path in ("fused", "multisteps"):
        for k in accum_steps:
            step = make_train_step(spec.loss, optimizer(), mesh=mesh, accum_steps=k, path=path)
            rows = bm.micro_batch_size * (k if path == "fused" else 1)
            batch = jax.device_put(bm.data(rows), sharding)
            calls = 1 if path == "fused" else k
            variants[f"{path}/{k}"] = _stepper(step, step.init(module), batch, calls)
    samples, calls = interleaved(variants, repeats=repeats, sample_seconds=sample_seconds)
    micro, update = samples["floor/micro"], samples["floor/update"]
    rows = []
    for path in ("fused", "multisteps"):
        for k in accum_steps:
            times = samples[f"{path}/{k}"]
            floors = [k * m + u for m, u in zip(micro, update, strict=True)]
            ratios = [t / f for t, f in zip(times, floors, strict=True)]
            rows.append(
                {
                    "path": path,
                    "accum_steps": k,
                    "step_seconds": median(times),
                    "floor_seconds": median(floors),
                    # Per repeat, step and floor were timed minutes apart at most:
                    # their ratio is steadier than the ratio of medians on a busy machine.
                    "ratio": median(ratios),
                    "ratios": ratios,
                }
            )
    return {
        "model": bm.name,
        "describe": bm.describe(),
        "micro_batch_size": bm.micro_batch_size,
        "micro_seconds": median(micro),
        "update_seconds": median(update),
        "accumulate_seconds": median(samples["floor/add"]),
        "calls_per_sample": calls,
        "rows": rows,
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = standard_args(__doc__.split("\n")[0], argv)
    from ..._mesh import emulate_cpu_devices

    emulate_cpu_devices(1)
    started = time.perf_counter()
    ks = QUICK_ACCUM_STEPS if args.quick else ACCUM_STEPS
    repeats, sample_seconds = (2, 0.01) if args.quick else (9, 0.1)
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
        "models": models,
    }
    write_result(args.out, "overhead", result, started)


if __name__ == "__main__":
    main()

"""Memory: XLA's analysis of the compiled fused step against K, and the batch that fits.

At a fixed global batch, the fused step over ``K`` micro-batches of
``per_device / K`` rows is compared with a step over ONE micro-batch of that
size (``K = 1``): accumulation should add the gradient accumulator, not ``K``
micro-batches of activations. Then the largest global batch whose compiled
step fits a stated per-device budget, without accumulation (``K = 1``, the
micro-batch grows) and with it (the micro-batch fixed, ``K`` grows). Figures
are per device from ``compiled.memory_analysis()`` (compiled with abstract
batches: nothing is allocated). Deterministic: no timing.

Run: ``python -m benchmarks.harness.memory --out DIR [--quick]``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ._common import BenchModel, bench_models, standard_args

NUM_DEVICES = 4
ACCUM_STEPS = (1, 2, 4, 8, 16)
QUICK_ACCUM_STEPS = (1, 2)
BUDGET = 2**28  # 256 MiB per device: small enough that the CPU search stays quick
QUICK_BUDGET = 2**22
MAX_COMPILES = 12  # per search


class FusedSteps:
    """jaxdp's fused step for ``bm`` under AdamW (``optax.adamw(1e-3)``, as ``jaxdp plan``
    compiles it), compiled for any micro-batch size and ``K`` with abstract batches:
    nothing but the one state is allocated, so large sizes cost only compile time."""

    def __init__(self, bm: BenchModel, mesh: Any):
        import optax

        self.bm, self.mesh, self.optimizer = bm, mesh, optax.adamw(1e-3)
        self._steps: dict[int, Any] = {}
        self._memory: dict[tuple[int, int], Any] = {}
        self._state = None

    def step(self, accum_steps: int) -> Any:
        from jaxdp import make_train_step

        if accum_steps not in self._steps:
            self._steps[accum_steps] = make_train_step(
                self.bm.loss, self.optimizer, mesh=self.mesh, accum_steps=accum_steps
            )
        return self._steps[accum_steps]

    def compiled(self) -> list[tuple[int, int]]:
        """The ``(micro_batch_size, accum_steps)`` pairs compiled so far."""
        return list(self._memory)

    def memory(self, micro_batch_size: int, accum_steps: int = 1) -> Any:
        """XLA's per-device figures (:class:`jaxdp.plan.CompiledMemory`) of the step over
        ``accum_steps`` micro-batches of ``micro_batch_size`` rows per device."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from jaxdp.plan import compiled_memory

        key = (micro_batch_size, accum_steps)
        if key not in self._memory:
            step = self.step(accum_steps)
            if self._state is None:  # one state for every K: lowering does not consume it
                self._state = self.step(1).init(self.bm.make())
            rows = self.mesh.devices.size * accum_steps * micro_batch_size
            by_rows = NamedSharding(self.mesh, P(self.mesh.axis_names[0]))
            batch = tuple(
                jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype, sharding=by_rows)
                for x in self.bm.data(1)
            )
            weights = jax.ShapeDtypeStruct(
                (accum_steps,), jnp.float32, sharding=NamedSharding(self.mesh, P())
            )
            compiled = step.lower(self._state, batch, weights).compile()
            self._memory[key] = compiled_memory(compiled)
        return self._memory[key]


def param_count(bm: BenchModel) -> int:
    """Parameters of the model (built abstractly: nothing is allocated)."""
    import jax
    from flax import nnx

    params = nnx.state(nnx.eval_shape(bm.make), nnx.Param)
    return sum(x.size for x in jax.tree.leaves(params))


def largest_fitting(
    total: Callable[[int], int], budget: int, *, limit: int = 2**30, known: Iterable[int] = ()
) -> dict:
    """The largest ``n >= 1`` with ``total(n) <= budget``, for ``total`` increasing in ``n``.

    XLA's total is close to affine in the batch rows and in ``K`` beyond ``K = 1``
    (at ``K = 1`` there is no loop and no accumulator): the line through the
    two nearest points read predicts the answer, which is compiled, and so
    is the size one above the answer to show it does not fit. ``known``: sizes
    whose totals are at hand (compiled for the other figures), read first, so that
    the line starts from them rather than from 1 and 2. Each compile narrows the
    bracket ``[fits, does not fit)``; at most ``MAX_COMPILES``, ``known`` not counted.
    """
    known = set(known)
    seen: dict[int, int] = {}

    def fits(n: int) -> bool:
        if n not in seen:
            seen[n] = total(n)
        return seen[n] <= budget

    def compiles() -> int:
        return len(seen.keys() - known)

    if not fits(1):
        return {"largest": 0, "compiles": compiles(), "total": seen[1], "verified": True}
    lo, hi = 1, limit + 1  # fits(lo); hi does not fit, or lies past the limit

    def narrow(n: int) -> None:
        nonlocal lo, hi
        if fits(n):
            lo = max(lo, n)
        else:
            hi = min(hi, n)

    def next_probe() -> int:
        points = sorted(seen)
        a = max((n for n in points if n < lo and n > 1), default=None)  # K = 1 is off the line
        left, right = (lo, hi) if hi in seen else ((a, lo) if a is not None else (lo, lo))
        slope = (seen[right] - seen[left]) / (right - left) if right != left else 0.0
        guess = lo + int((budget - seen[lo]) // slope) if slope > 0 else 2 * lo
        probe = min(max(guess, lo + 1), hi - 1)
        if probe in seen:  # the line points at a compiled size: step next to it
            probe = lo + 1 if probe <= lo else hi - 1
        return probe

    for n in sorted(known - {1}):
        if n <= limit:
            narrow(n)
    while hi - lo > 1 and compiles() < MAX_COMPILES:
        narrow(next_probe())
    verified = hi - lo == 1 and hi in seen
    return {"largest": lo, "compiles": compiles(), "total": seen[lo], "verified": verified}


def measure_model(
    bm: BenchModel, accum_steps: Sequence[int], mesh: Any, budget: int
) -> dict[str, Any]:
    from jaxdp import make_train_step
    from jaxdp.plan import compiled_memory

    n = mesh.devices.size
    steps = FusedSteps(bm, mesh)
    per_device = bm.micro_batch_size * max(accum_steps)  # fixed global batch: n * per_device
    accumulator = 4 * param_count(bm)  # jaxdp's float32 gradient sum
    row_bytes = sum(x.nbytes for x in bm.data(1))  # one row: inputs and labels
    rows = []
    for k in accum_steps:
        micro = per_device // k
        fused, single = steps.memory(micro, k), steps.memory(micro, 1)
        rows.append(
            {
                "accum_steps": k,
                "micro_batch_size": micro,
                "fused": dataclasses.asdict(fused) | {"total": fused.total},
                "single_micro_batch": dataclasses.asdict(single) | {"total": single.total},
                "temp_ratio": fused.temporaries / single.temporaries,
                # What the loop adds to one micro-batch's step: the accumulator, and
                # the micro-batch it slices out of the batch argument.
                "excess_bytes": fused.temporaries - single.temporaries,
                "accumulator_bytes": accumulator if k > 1 else 0,
                "micro_input_bytes": micro * row_bytes if k > 1 else 0,
            }
        )
    # The rows compiled some sizes already: the searches start from them.
    m, compiled = bm.micro_batch_size, steps.compiled()
    without = largest_fitting(
        lambda b: steps.memory(b, 1).total, budget, known=[b for b, k in compiled if k == 1]
    )
    with_accum = largest_fitting(
        lambda k: steps.memory(m, k).total, budget, known=[k for b, k in compiled if b == m]
    )
    multi = make_train_step(bm.loss, steps.optimizer, mesh=mesh, path="multisteps")
    multisteps = compiled_memory(multi.compile(multi.init(bm.make()), bm.data(n * m)))
    return {
        "model": bm.name,
        "describe": bm.describe(),
        "global_batch_size": n * per_device,
        "rows": rows,
        "budget": budget,
        "largest_without_accumulation": without
        | {"micro_batch_size": without["largest"], "global_batch_size": n * without["largest"]},
        "largest_with_accumulation": with_accum
        | {
            "micro_batch_size": m,
            "accum_steps": with_accum["largest"],
            "global_batch_size": n * m * with_accum["largest"],
        },
        "multisteps_micro_step": dataclasses.asdict(multisteps) | {"total": multisteps.total},
    }


def main(argv: Sequence[str] | None = None, *, shared: bool = False) -> None:
    """``shared``: in :mod:`._together`'s process, whose devices are set (the first
    ``NUM_DEVICES`` are used)."""
    args = standard_args(__doc__.split("\n")[0], argv)
    from jaxdp import data_mesh, emulate_cpu_devices

    if not shared:
        emulate_cpu_devices(NUM_DEVICES)
    started = time.perf_counter()
    ks = QUICK_ACCUM_STEPS if args.quick else ACCUM_STEPS
    budget = QUICK_BUDGET if args.quick else BUDGET
    mesh = data_mesh(NUM_DEVICES)
    models = [measure_model(bm, ks, mesh, budget) for bm in bench_models(args.quick)]
    from ._common import write_result

    result = {
        "quick": args.quick,
        "num_devices": NUM_DEVICES,
        "accum_steps": list(ks),
        "budget": budget,
        "models": models,
    }
    write_result(args.out, "memory", result, started)


if __name__ == "__main__":
    main()

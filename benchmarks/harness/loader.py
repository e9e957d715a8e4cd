"""Input pipeline: loader-fed steps against pre-placed batches, a slow source, and memory.

1. Overhead: time per optimizer step of a step fed by :class:`jaxdp.data.Loader`
   (an in-memory source: its threads read, stack and place every call) over
   the same step fed batches already on the devices; both accumulation paths,
   the MLP and the character GPT on 4 emulated devices, timed in turns.
2. Slow source: every row read sleeps, so that reading one global batch on
   one thread costs about one pre-placed step; the loader-fed step over the
   pre-placed one against the number of worker threads (the prefetch curve).
3. Memory: the loop stops taking batches; after a wait, the calls the loader
   has read ahead and the placed batches alive on the devices
   (``jax.live_arrays``), against its ``prefetch`` depth.
4. Sources: rows per second through the loader (read, stacked, placed) of one
   data set as numpy arrays, a Hugging Face ``datasets.Dataset`` read record by
   record (as the loader read one before issue 26) and read a call at a time,
   and a grain ``MapDataset``; HF's own batched indexing (``ds[rows]``, no
   loader) is the ceiling.

Run: ``python -m benchmarks.harness.loader --out DIR [--quick]``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ._common import (
    BenchModel,
    bench_models,
    interleaved,
    load_average,
    median,
    optimizer,
    standard_args,
)

NUM_DEVICES = 4
ACCUM_STEPS = 2
PATHS = ("fused", "multisteps")
WORKERS, QUICK_WORKERS = (1, 2, 4, 8), (1, 2)
STEPS_OF_DATA = 64  # the source holds this many global batches (the loader cycles over it)


class SlowArray:
    """An array read as the loader reads one: ``x[rows]``, sleeping ``delay`` seconds per
    row (a file or network read; one sleep per call, as short sleeps overshoot), and
    counting the rows read."""

    def __init__(self, x: np.ndarray, delay: float):
        self.x, self.delay, self.rows_read = x, delay, 0
        self.shape, self.dtype = x.shape, x.dtype
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        if self.delay:
            time.sleep(self.delay * len(rows))  # releases the GIL, as I/O does
        with self._lock:
            self.rows_read += len(rows)
        return self.x[rows]


def _setup(bm: BenchModel, path: str, mesh: Any) -> tuple[Any, Any, Any]:
    """The step, its batch identity and a source of ``STEPS_OF_DATA`` global batches."""
    from jaxdp import batch_sizes, make_train_step

    sizes = batch_sizes(
        num_devices=NUM_DEVICES, accum_steps=ACCUM_STEPS, micro_batch_size=bm.micro_batch_size
    )
    step = make_train_step(bm.loss, optimizer(), mesh=mesh, accum_steps=ACCUM_STEPS, path=path)
    return step, sizes, bm.data(STEPS_OF_DATA * sizes.global_batch_size)


def _preplaced(step: Any, sizes: Any, data: Any, module: Any) -> Callable[[], Any]:
    """One optimizer step over batches already on the mesh (cycling over a few)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdp import DATA_AXIS

    calls = 1 if step.path == "fused" else ACCUM_STEPS
    rows = sizes.global_batch_size // calls
    sharding = NamedSharding(step.mesh, P(DATA_AXIS))
    batches = itertools.cycle(
        [
            jax.device_put(tuple(x[i * rows : (i + 1) * rows] for x in data), sharding)
            for i in range(4)
        ]
    )
    box = [step.init(module)]

    def run() -> Any:
        for _ in range(calls):
            box[0], metrics = step(box[0], next(batches))
        return metrics["loss"]

    return run


def _fed(step: Any, loader: Any, module: Any) -> Callable[[], Any]:
    """One optimizer step over the loader's next calls (it runs ahead between turns)."""
    box: list[Any] = [step.init(module)]
    batches: Iterator[Any] = iter(loader)

    def run() -> Any:
        while True:
            batch = next(batches)
            box[0], metrics = step(box[0], batch.data, batch.micro_weights)
            if batch.emits:
                return metrics["loss"]

    return run


def _ratios(samples: dict[str, list[float]], name: str, baseline: str) -> dict[str, Any]:
    ratios = [a / b for a, b in zip(samples[name], samples[baseline], strict=True)]
    return {"step_seconds": median(samples[name]), "ratio": median(ratios), "ratios": ratios}


def overhead(bm: BenchModel, mesh: Any, *, repeats: int, seconds: float) -> list[dict]:
    from jaxdp.data import Loader

    module, variants = bm.make(), {}
    for path in PATHS:
        step, sizes, data = _setup(bm, path, mesh)
        loader = Loader(data, sizes, mesh=mesh, path=path, epochs=None)
        variants[f"{path}/pre-placed"] = _preplaced(step, sizes, data, module)
        variants[f"{path}/loader"] = _fed(step, loader, module)
    samples, _ = interleaved(variants, repeats=repeats, sample_seconds=seconds)
    return [
        {"path": path, "pre_placed_seconds": median(samples[f"{path}/pre-placed"])}
        | _ratios(samples, f"{path}/loader", f"{path}/pre-placed")
        for path in PATHS
    ]


def slow_source(
    bm: BenchModel, mesh: Any, workers: Sequence[int], *, repeats: int, seconds: float
) -> dict[str, Any]:
    """The prefetch curve on the fused path: the delay per row makes one global batch
    read on one thread cost about one pre-placed step."""
    from jaxdp.data import Loader

    module = bm.make()
    step, sizes, data = _setup(bm, "fused", mesh)
    baseline = _preplaced(step, sizes, data, module)
    probe, _ = interleaved({"step": baseline}, repeats=3, sample_seconds=seconds)
    delay = median(probe["step"]) / sizes.global_batch_size
    variants = {"pre-placed": baseline}
    for n in workers:
        source = (SlowArray(data[0], delay), data[1])
        loader = Loader(source, sizes, mesh=mesh, epochs=None, workers=n)
        variants[f"workers={n}"] = _fed(step, loader, module)
    samples, _ = interleaved(variants, repeats=repeats, sample_seconds=seconds)
    return {
        "model": bm.name,
        "delay_per_record_seconds": delay,
        "single_thread_read_seconds": delay * sizes.global_batch_size,
        "pre_placed_seconds": median(samples["pre-placed"]),
        "rows": [{"workers": n} | _ratios(samples, f"workers={n}", "pre-placed") for n in workers],
    }


def held(bm: BenchModel, mesh: Any, *, prefetch: int, workers: int) -> dict[str, Any]:
    """What a loader holds while the loop does not take batches, after one call: the
    placed batches alive count the loop's last one (the generator keeps it until the
    next call) and one waiting to enter the full queue, so at most ``prefetch + 2``."""
    import jax

    from jaxdp.data import Loader

    _, sizes, data = _setup(bm, "fused", mesh)
    # The other measurements' arrays, held (so that no new array takes one's id).
    earlier = jax.live_arrays()
    seen = {id(a) for a in earlier}
    x = SlowArray(data[0], 0.0)
    loader = Loader((x, data[1]), sizes, mesh=mesh, epochs=None, workers=workers, prefetch=prefetch)
    x.rows_read = 0  # the fingerprint's pass over the data at construction is no read-ahead
    batches = iter(loader)
    first = next(batches)
    shapes = {leaf.shape for leaf in jax.tree.leaves(first.data)}
    del first
    time.sleep(1.0)  # the background threads fill what they may
    alive = [a for a in jax.live_arrays() if id(a) not in seen and a.shape in shapes]
    placed = len(alive) // len(shapes)
    read_calls = x.rows_read // sizes.global_batch_size
    batches.close()
    return {
        "prefetch": prefetch,
        "workers": workers,
        "placed_batches_alive": placed,
        "placed_bytes": sum(a.nbytes for a in alive),
        "batch_bytes": sum(leaf.nbytes for leaf in data) // STEPS_OF_DATA,
        "calls_read": read_calls,  # the first call's included
    }


class OneByOne:
    """A source with only ``__len__`` and ``__getitem__(i)``: read one record at a time."""

    def __init__(self, source: Any):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Any:
        return self.source[index]


SOURCE_ROWS, SOURCE_FEATURES = 20_000, 6
SOURCE_CALLS = 8  # calls read per sample, by a fresh iteration of the loader


def _reading(loader: Any, calls: int) -> Callable[[], Any]:
    """``calls`` calls of the loader, read by a fresh iteration (no head start)."""

    def run() -> Any:
        for _, batch in zip(range(calls), loader, strict=False):
            last = batch.data
        return last

    return run


def sources(mesh: Any, *, quick: bool, repeats: int, seconds: float) -> dict[str, Any]:
    """Rows per second through the loader, one worker thread, fused calls of 4 devices x
    2 micro-batches of 32 rows (256 rows), shuffled, from each kind of source."""
    import grain

    from jaxdp import batch_sizes, epoch_schedule
    from jaxdp.data import Loader

    sizes = batch_sizes(num_devices=NUM_DEVICES, accum_steps=ACCUM_STEPS, micro_batch_size=32)
    n = SOURCE_ROWS // 10 if quick else SOURCE_ROWS
    rng = np.random.default_rng(0)
    arrays = {
        "x": rng.normal(size=(n, SOURCE_FEATURES)).astype(np.float32),
        "y": rng.integers(0, 10, n),
    }
    records = [{"x": arrays["x"][i], "y": arrays["y"][i]} for i in range(n)]
    kinds: dict[str, Any] = {
        "numpy arrays": arrays,
        "grain MapDataset": grain.MapDataset.source(records),
    }
    try:
        import datasets
    except ImportError:  # a test extra: the HF rows are left out without it
        datasets = None
    if datasets is not None:
        hf = datasets.Dataset.from_dict(arrays)  # default (python) format
        kinds["HF Dataset, record by record"] = OneByOne(hf.with_format("numpy"))
        kinds["HF Dataset, batched (jaxdp)"] = hf
    variants = {
        name: _reading(Loader(kind, sizes, mesh=mesh, workers=1, epochs=None), SOURCE_CALLS)
        for name, kind in kinds.items()
    }
    if datasets is not None:
        view, rows = hf.with_format("numpy"), epoch_schedule(n, sizes).rows
        calls = itertools.cycle([r.tolist() for r in rows])
        variants["HF's own ds[rows] (ceiling)"] = lambda: [
            view[next(calls)] for _ in range(SOURCE_CALLS)
        ][-1]["x"]
    samples, _ = interleaved(variants, repeats=repeats, sample_seconds=seconds)
    rows_per_sample = SOURCE_CALLS * sizes.global_batch_size
    return {
        "rows": n,
        "features": SOURCE_FEATURES,
        "global_batch_size": sizes.global_batch_size,
        "workers": 1,
        "kinds": [
            {
                "source": name,
                "seconds": (t := median(samples[name])),
                "rows_per_second": rows_per_sample / t,
            }
            for name in variants
        ],
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = standard_args(__doc__.split("\n")[0], argv)
    from jaxdp import data_mesh, emulate_cpu_devices

    emulate_cpu_devices(NUM_DEVICES)
    started, load_start = time.perf_counter(), load_average()
    repeats, seconds = (2, 0.01) if args.quick else (9, 0.2)
    workers = QUICK_WORKERS if args.quick else WORKERS
    mesh = data_mesh(NUM_DEVICES)
    models = bench_models(args.quick)
    result = {
        "quick": args.quick,
        "num_devices": NUM_DEVICES,
        "accum_steps": ACCUM_STEPS,
        "repeats": repeats,
        "sample_seconds": seconds,
        "load_average_start": load_start,
        "models": [
            {"model": bm.name, "describe": bm.describe(), "micro_batch_size": bm.micro_batch_size}
            | {"rows": overhead(bm, mesh, repeats=repeats, seconds=seconds)}
            for bm in models
        ],
        "slow_source": slow_source(models[0], mesh, workers, repeats=repeats, seconds=seconds),
        "memory": [held(models[0], mesh, prefetch=p, workers=2) for p in (1, 2, 4)],
        "sources": sources(mesh, quick=args.quick, repeats=repeats, seconds=seconds),
    }
    from ._common import write_result

    write_result(args.out, "loader", result, started)


if __name__ == "__main__":
    main()

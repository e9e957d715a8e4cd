"""What every measurement shares: its models, data, optimizer, timing and environment record."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxdp.parity import OptimizerSpec, optax_like_torch

# AdamW in torch's terms, so torch_ref builds the same optimizer (eps_root=0, same decay).
OPTIMIZER = OptimizerSpec("adamw", 1e-3, weight_decay=1e-2)


def split_params(module: Any) -> tuple[Any, Any, Any]:
    """``(graphdef, params, rest)``: the module's ``nnx.Param`` variables apart, as jaxdp
    trains them (the same pytree as ``TrainState.params``)."""
    from flax import nnx

    return nnx.split(module, nnx.Param, ...)


def micro_loss(bm: BenchModel, module: Any) -> tuple[Callable[[Any, Any], Any], Any]:
    """``(loss(params, micro_batch), params)``: one micro-batch's mean loss, the model's
    loss on the module rebuilt from ``params`` (its other state held fixed: the bench's
    models have no batch statistics or dropout), differentiable in params."""
    from flax import nnx

    graphdef, params, rest = split_params(module)

    def loss(params: Any, batch: Any) -> Any:
        return bm.loss(nnx.merge(graphdef, params, rest), batch)

    return loss, params


@dataclasses.dataclass(frozen=True)
class BenchModel:
    """A reference model at benchmark sizes, with its micro-batch size."""

    name: str  # the label in tables and plots
    # the jaxdp / torch_ref reference model: "mlp" or "transformer"; or "scanned", jaxdp's
    # ScannedTransformer (its blocks looped by jaxdp.scan_layers: the ZeRO stage-3 rows)
    kind: str
    kwargs: dict[str, int]  # constructor sizes (empty: the reference defaults)
    micro_batch_size: int

    def make(self) -> Any:
        """The :mod:`jaxdp.models` reference model at these sizes (float32, seed 0)."""
        from flax import nnx

        from jaxdp.models import MODELS, ScannedTransformer

        cls = ScannedTransformer if self.kind == "scanned" else MODELS[self.kind][0]
        return cls(**self.kwargs, rngs=nnx.Rngs(0))

    @property
    def loss(self) -> Callable[[Any, Any], Any]:
        """``loss(module, (x, y))``: the reference model's micro-batch mean loss."""
        from jaxdp.models import MODELS

        return MODELS["transformer" if self.kind == "scanned" else self.kind][1]

    def sizes(self) -> dict[str, int]:
        """Constructor sizes, defaults filled in."""
        if self.kind == "mlp":
            return {"in_features": 16, "hidden": 32, "num_classes": 4} | self.kwargs
        gpt = {"vocab_size": 32, "block_size": 8, "d_model": 16, "n_heads": 2}
        if self.kind == "scanned":
            gpt["n_layers"] = 2
        return gpt | self.kwargs

    def describe(self) -> str:
        s = self.sizes()
        if self.kind == "mlp":
            return f"MLP {s['in_features']}-{s['hidden']}-{s['hidden']}-{s['num_classes']}"
        blocks = f"{s['n_layers']}-block scanned" if self.kind == "scanned" else "1-block"
        return (
            f"{blocks} GPT (vocab {s['vocab_size']}, context {s['block_size']}, "
            f"width {s['d_model']}, {s['n_heads']} heads)"
        )

    def data(self, rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """A batch of ``rows``: float32 features and int32 labels, or int32 token windows."""
        rng = np.random.default_rng(seed)
        s = self.sizes()
        if self.kind == "mlp":
            x = rng.normal(size=(rows, s["in_features"])).astype(np.float32)
            return x, rng.integers(0, s["num_classes"], size=rows).astype(np.int32)
        tokens = rng.integers(0, s["vocab_size"], size=(rows, s["block_size"] + 1))
        tokens = tokens.astype(np.int32)
        return tokens[:, :-1].copy(), tokens[:, 1:].copy()


# The MLP at a width where one micro-batch is milliseconds of compute (at the
# reference 16-32-32-4 sizes it is microseconds: dispatch, not accumulation,
# would be measured), and the character GPT of examples/char_gpt.py.
MODELS = (
    BenchModel("mlp", "mlp", {"in_features": 256, "hidden": 1024, "num_classes": 10}, 64),
    BenchModel(
        "gpt",
        "transformer",
        {"vocab_size": 103, "block_size": 64, "d_model": 128, "n_heads": 4},
        16,
    ),
)
# torch_ref's own MLP (16-32-32-4): a framework-overhead comparison.
REFERENCE_MLP = BenchModel("mlp-ref", "mlp", {}, 64)
# --quick: the reference MLP at a tiny micro-batch; compiling dominates its time.
QUICK_MODELS = (BenchModel("mlp", "mlp", {}, 8),)


def bench_models(quick: bool) -> tuple[BenchModel, ...]:
    return QUICK_MODELS if quick else MODELS


def optimizer() -> Any:
    return optax_like_torch(OPTIMIZER)


def param_bytes(params: Any) -> int:
    import jax

    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


# ---- timing -------------------------------------------------------------------------


def _wait(out: Any) -> None:
    if out is not None:
        import jax

        jax.block_until_ready(out)


def time_calls(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls, waiting once at the end.

    Dispatch of the next call overlaps the running one (as in a training loop
    that does not read every result), so per-call host overhead is not counted
    unless the call itself waits (e.g. reads the loss).
    """
    start = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn()
    _wait(out)
    return (time.perf_counter() - start) / calls


def interleaved(
    variants: dict[str, Callable[[], Any]],
    *,
    repeats: int,
    sample_seconds: float,
    warmup: int = 2,
    max_calls: int = 1000,
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Seconds per call of every variant, ``repeats`` samples each, taken in turns.

    After ``warmup`` calls (compilation included there), each variant gets the
    number of calls that takes about ``sample_seconds``. Every repeat times all
    variants once, in alternating order, so slow drifts of a shared machine
    hit all of them alike; ratios are formed within a repeat.
    """
    calls = {}
    for name, fn in variants.items():
        for _ in range(warmup):
            _wait(fn())
        once = time_calls(fn, 1)
        calls[name] = int(min(max_calls, max(1, round(sample_seconds / max(once, 1e-9)))))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name].append(time_calls(variants[name], calls[name]))
    return samples, calls


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# ---- environment and results -----------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_threads() -> int:
    """CPUs this process may run on (its affinity), which XLA's CPU thread pools follow."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def environment() -> dict[str, Any]:
    """Machine, versions and threads, recorded with every result."""
    packages = ("jax", "jaxlib", "flax", "optax", "numpy", "torch")
    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_threads": cpu_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": {p: _version(p) for p in packages},
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def write_result(out: Path, name: str, result: dict[str, Any], started: float) -> Path:
    """Writes ``out/<name>.json`` with the environment and the measurement's wall time."""
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    env["load_average_end"] = env.pop("load_average")
    record = {"name": name, "wall_seconds": time.perf_counter() - started, "env": env, **result}
    path = out / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    return path


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def standard_args(description: str, argv: Sequence[str] | None) -> Any:
    """``--out DIR --quick``: the arguments every measurement module takes."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, required=True, help="directory for <name>.json")
    p.add_argument("--quick", action="store_true", help="smoke sizes (for the tests)")
    return p.parse_args(argv)

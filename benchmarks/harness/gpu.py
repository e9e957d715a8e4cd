"""GPU: a GPT-2-small-sized model in bf16 on one GPU, jaxdp's fused step against torch.compile.

Not in ``bin/jaxdp bench``'s default run and never in CI: it needs a GPU. Run it
there with ``bin/jaxdp bench --only gpu`` or ``python benchmarks/gpu_gpt2.py``;
``--tiny`` runs the same code at toy sizes on any machine (a check, no figures).

1. The peak: a large bf16 ``jnp.dot`` (8192 x 8192 x 8192), median of timed runs.
2. jaxdp: the fused step (``accum_steps`` micro-batches, one call), float32
   parameters and accumulator, bf16 compute.
3. torch: the same model (same layers, tied head, flash attention through
   ``scaled_dot_product_attention``), ``torch.compile``d, bf16 autocast, fp32
   parameters, the usual accumulation loop (``loss / K``, backward per
   micro-batch, fused AdamW step).

Model FLOPs per token (nanoGPT's ``estimate_mfu``, PaLM appendix B):
``6 N + 12 L d T``, ``N`` the parameters without the position embeddings
(the tied token embedding counts once: it is the head's matmul), the second
term the attention scores and values over the full ``T x T`` (causal
attention does about half of it). MFU = FLOPs per token x tokens/s / peak; the
table also gives it with ``6 N`` alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64, as nanoGPT does
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768


GPT2_SMALL = GPTConfig()
TINY = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, d_model=32)


def param_count(cfg: GPTConfig) -> int:
    """Parameters of :class:`GPT2` (tied head): 124,439,808 at GPT-2's vocabulary of 50257."""
    d = cfg.d_model
    per_layer = 12 * d * d + 13 * d  # qkv, proj, fc, fc_proj with biases; two LayerNorms
    return (cfg.vocab_size + cfg.block_size) * d + cfg.n_layer * per_layer + 2 * d


def flops_per_token(cfg: GPTConfig) -> dict[str, int]:
    n = param_count(cfg) - cfg.block_size * cfg.d_model  # position embeddings: a lookup
    attention = 12 * cfg.n_layer * cfg.d_model * cfg.block_size
    return {"6N": 6 * n, "6N+attention": 6 * n + attention}


# ---- the model, in Flax NNX and in torch --------------------------------------------


def nnx_model(
    cfg: GPTConfig,
    *,
    dtype: Any,
    seed: int = 0,
    attention: str | None = None,
    tp: bool = False,
) -> Any:
    """GPT-2 in NNX; ``attention`` is ``jax.nn.dot_product_attention``'s ``implementation``
    (None: XLA's choice; ``"cudnn"``: cuDNN's flash attention, GPUs only). ``tp``:
    Megatron's plan over a ``"model"`` axis in the Variables' metadata (for
    ``Parallel(model_axes=("model",))``): ``qkv`` and ``fc`` column-split, ``proj`` and
    ``fc_proj`` row-split, the embeddings and norms whole; ``qkv``'s outputs are then
    ordered head by head (each head's q, k and v side by side), so that a split of them
    keeps whole heads on a device."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    rngs = nnx.Rngs(seed)
    kw = {"dtype": dtype, "param_dtype": jnp.float32, "rngs": rngs}

    def split(kernel: tuple, bias: tuple) -> dict[str, Any]:
        if not tp:
            return {}
        meta = {"eager_sharding": False}
        return {
            "kernel_metadata": {"out_sharding": kernel, **meta},
            "bias_metadata": {"out_sharding": bias, **meta},
        }

    col, row = split((None, "model"), ("model",)), split(("model", None), (None,))

    class Block(nnx.Module):
        def __init__(self) -> None:
            d = cfg.d_model
            self.ln1 = nnx.LayerNorm(d, epsilon=1e-5, **kw)
            self.qkv = nnx.Linear(d, 3 * d, **kw, **col)
            self.proj = nnx.Linear(d, d, **kw, **row)
            self.ln2 = nnx.LayerNorm(d, epsilon=1e-5, **kw)
            self.fc = nnx.Linear(d, 4 * d, **kw, **col)
            self.fc_proj = nnx.Linear(4 * d, d, **kw, **row)

        def __call__(self, x: jax.Array) -> jax.Array:
            b, t, d = x.shape
            h = cfg.n_head
            if tp:  # head-major: [b, t, heads, (q, k, v), head width]
                qkv = self.qkv(self.ln1(x)).reshape(b, t, h, 3, d // h)
                q, k, v = (qkv[:, :, :, i] for i in range(3))
            else:
                q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
                q, k, v = (y.reshape(b, t, h, d // h) for y in (q, k, v))
            # implementation=None is XLA's attention (it writes the T x T scores); "cudnn" is
            # cuDNN's flash attention, as torch's scaled_dot_product_attention runs on a GPU.
            att = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
            x = x + self.proj(att.reshape(b, t, d))
            return x + self.fc_proj(jax.nn.gelu(self.fc(self.ln2(x)), approximate=True))

    class GPT2(nnx.Module):
        def __init__(self) -> None:
            self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, **kw)
            self.wpe = nnx.Embed(cfg.block_size, cfg.d_model, **kw)
            self.blocks = nnx.List([Block() for _ in range(cfg.n_layer)])
            self.ln_f = nnx.LayerNorm(cfg.d_model, epsilon=1e-5, **kw)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.wte.attend(self.ln_f(x))  # the head shares the token embedding

    return GPT2()


def nnx_loss(model: Any, batch: tuple[Any, Any]) -> Any:
    import jax.numpy as jnp
    import optax

    x, y = batch
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def torch_model(cfg: GPTConfig) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = cfg.d_model
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (y.view(b, t, cfg.n_head, d // cfg.n_head).transpose(1, 2) for y in (q, k, v))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
            return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.wte(tokens) + self.wpe(positions)
            for block in self.blocks:
                x = block(x)
            return F.linear(self.ln_f(x), self.wte.weight)  # tied head

    return GPT2()


# ---- measurements ------------------------------------------------------------------------


def _timed(
    step: Callable[[], Any], sync: Callable[[Any], Any], *, warmup: int, repeats: int, calls: int
) -> list[float]:
    for _ in range(warmup):
        sync(step())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = step()
        sync(out)
        samples.append((time.perf_counter() - start) / calls)
    return samples


def matmul_peak(n: int, repeats: int) -> dict[str, Any]:
    """bf16 ``jnp.dot`` of two ``n x n`` matrices: FLOP/s (2 n^3 per product)."""
    import jax
    import jax.numpy as jnp

    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in (0, 1))
    dot = jax.jit(jnp.dot)
    samples = _timed(lambda: dot(a, b), jax.block_until_ready, warmup=3, repeats=repeats, calls=10)
    seconds = float(np.median(samples))
    return {"n": n, "seconds": seconds, "flops_per_second": 2 * n**3 / seconds}


def batch(cfg: GPTConfig, rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, size=(rows, cfg.block_size + 1)).astype(np.int32)
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


def jaxdp_run(
    cfg: GPTConfig,
    micro: int,
    accum_steps: int,
    *,
    dtype: Any,
    repeats: int,
    calls: int,
    path: str = "fused",
    zero_stage: int = 0,
) -> list[float]:
    """Seconds per optimizer step of jaxdp's step: one call of ``accum_steps`` micro-batches
    (``fused``), or ``accum_steps`` consecutive calls of one micro-batch (``multisteps``)."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdp import Parallel, data_mesh, make_train_step

    mesh = data_mesh(1)
    step = make_train_step(
        nnx_loss,
        optax.adamw(3e-4, weight_decay=0.1),
        mesh=mesh,
        accum_steps=accum_steps,
        path=path,
        parallel=Parallel(zero_stage=zero_stage),
    )
    # On a GPU, cuDNN's flash attention (torch's side runs flash attention too); XLA's
    # attention halves the tokens/s there (benchmarks/studies/gpu_floor.py, BENCHMARKS.md).
    attention = "cudnn" if jax.default_backend() == "gpu" else None
    box = [step.init(nnx_model(cfg, dtype=dtype, attention=attention))]
    sharding = NamedSharding(mesh, P(mesh.axis_names[0]))
    x, y = batch(cfg, micro * accum_steps)
    if path == "fused":
        calls_per_step = [jax.device_put((x, y), sharding)]
    else:
        calls_per_step = [
            jax.device_put(
                (x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]), sharding
            )
            for i in range(accum_steps)
        ]

    def run() -> Any:
        for data in calls_per_step:
            box[0], metrics = step(box[0], data)
        return metrics["loss"]

    return _timed(run, jax.block_until_ready, warmup=3, repeats=repeats, calls=calls)


def torch_run(
    cfg: GPTConfig, micro: int, accum_steps: int, *, compile: bool, repeats: int, calls: int
) -> list[float]:
    import torch
    import torch.nn.functional as F

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = torch_model(cfg).to(device)
    fused = device == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=fused)
    forward = torch.compile(model) if compile else model
    x, y = (torch.from_numpy(a).long().to(device) for a in batch(cfg, micro * accum_steps))
    xs, ys = x.split(micro), y.split(micro)

    def run() -> Any:
        for j in range(accum_steps):
            with torch.autocast(device, dtype=torch.bfloat16):
                logits = forward(xs[j])
            loss = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), ys[j].view(-1))
            (loss / accum_steps).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def sync(loss: Any) -> None:
        loss.item()

    return _timed(run, sync, warmup=3, repeats=repeats, calls=calls)


def _summary(seconds: list[float], tokens: int, flops: dict[str, int], peak: float) -> dict:
    step = float(np.median(seconds))
    rate = tokens / step
    return {
        "step_seconds": step,
        "seconds": seconds,
        "tokens_per_second": rate,
        "mfu": {name: f * rate / peak for name, f in flops.items()},
    }


def _device() -> dict[str, Any]:
    """The JAX device and the versions of the jax side (torch's come from its own process)."""
    import importlib.metadata

    import jax

    info = {"jax_device": str(jax.devices()[0].device_kind), "platform": jax.default_backend()}
    for package in ("jax", "jaxlib", "flax", "optax"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    return info


# The jaxdp step variants timed besides the default one (fused, stage 0): the name of the
# result row, then make_train_step's path and ZeRO stage.
VARIANTS = {"jaxdp_multisteps": ("multisteps", 0), "jaxdp_zero1": ("fused", 1)}


def _side(args: argparse.Namespace) -> dict[str, Any]:
    """One framework's measurements, in this process (``--side jax`` or ``--side torch``)."""
    cfg = TINY if args.tiny else GPT2_SMALL
    micro, k = (2, 2) if args.tiny else (args.micro_batch_size, args.accum_steps)
    repeats, calls = (1, 1) if args.tiny else (5, 3)
    if args.side == "torch":
        compile = not args.no_compile and not args.tiny
        seconds = torch_run(cfg, micro, k, compile=compile, repeats=repeats, calls=calls)
        return {"torch": {"seconds": seconds, "compiled": compile}}
    import jax.numpy as jnp

    out: dict[str, Any] = {
        "peak": matmul_peak(256 if args.tiny else 8192, repeats=repeats),
        "device": _device(),
    }
    out["jaxdp"] = {
        "seconds": jaxdp_run(cfg, micro, k, dtype=jnp.bfloat16, repeats=repeats, calls=calls)
    }
    for name, (path, stage) in VARIANTS.items() if args.variants else ():
        seconds = jaxdp_run(
            cfg,
            micro,
            k,
            dtype=jnp.bfloat16,
            repeats=repeats,
            calls=calls,
            path=path,
            zero_stage=stage,
        )
        out[name] = {"seconds": seconds, "path": path, "zero_stage": stage}
    return out


def _in_own_process(args: argparse.Namespace, side: str, timeout: float | None) -> dict[str, Any]:
    """Runs one side in a fresh process: timing torch and XLA in turns inside one process
    is biased (torch's OpenMP threads keep spinning; shared/DESIGN.md)."""
    import json
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / f"{side}.json"
        argv = [sys.executable, "-m", "benchmarks.harness.gpu", "--side", side, "--out", tmp]
        argv += ["--micro-batch-size", str(args.micro_batch_size)]
        argv += ["--accum-steps", str(args.accum_steps)]
        argv += ["--tiny"] * args.tiny + ["--no-compile"] * args.no_compile
        argv += ["--variants"] * args.variants
        root = Path(__file__).resolve().parents[2]
        subprocess.run(argv, check=True, cwd=root, timeout=timeout)
        return json.loads(result.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for gpu.json")
    p.add_argument("--tiny", action="store_true", help="toy sizes on any device: a check only")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--accum-steps", type=int, default=8)
    p.add_argument("--no-torch", action="store_true", help="jaxdp only")
    p.add_argument("--no-compile", action="store_true", help="torch eager instead of compile")
    p.add_argument(
        "--variants",
        action="store_true",
        help=f"also time jaxdp's {', '.join(VARIANTS)} (one compilation each)",
    )
    p.add_argument(
        "--side",
        choices=["both", "jax", "torch"],
        default="both",
        help="both (default): each framework in a fresh process of its own; jax or torch: "
        "that one, in this process, into <out>/<side>.json",
    )
    p.add_argument("--timeout-s", type=float, default=None, help="per side (default: none)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    if args.side != "both":
        import json

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.side}.json").write_text(json.dumps(_side(args)) + "\n")
        return 0
    if not args.tiny:
        import jax

        if jax.default_backend() != "gpu":
            print(
                f"jaxdp bench gpu: no GPU (JAX backend {jax.default_backend()!r}); "
                "run it on a GPU machine, or with --tiny to check the code"
            )
            return 2
    cfg = TINY if args.tiny else GPT2_SMALL
    micro, k = (2, 2) if args.tiny else (args.micro_batch_size, args.accum_steps)
    flops = flops_per_token(cfg)
    tokens = micro * k * cfg.block_size
    jax_side = _in_own_process(args, "jax", args.timeout_s)
    peak = jax_side["peak"]
    result = {
        "tiny": args.tiny,
        "config": dataclasses.asdict(cfg),
        "params": param_count(cfg),
        "micro_batch_size": micro,
        "accum_steps": k,
        "tokens_per_step": tokens,
        "flops_per_token": flops,
        "peak": peak,
        "device": jax_side["device"],
        "separate_processes": True,
    }
    for name, row in jax_side.items():
        if name.startswith("jaxdp"):
            summary = _summary(row.pop("seconds"), tokens, flops, peak["flops_per_second"])
            result[name] = {**summary, **row}
    if not args.no_torch:
        row = _in_own_process(args, "torch", args.timeout_s)["torch"]
        result["torch"] = {
            **_summary(row["seconds"], tokens, flops, peak["flops_per_second"]),
            "compiled": row["compiled"],
        }
        result["device"]["torch"] = _torch_versions()
    from ._common import write_result

    path = write_result(args.out, "gpu", result, started)
    print(f"wrote {path}")
    return 0


def _torch_versions() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"version": torch.__version__}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


if __name__ == "__main__":
    raise SystemExit(main())

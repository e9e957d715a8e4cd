"""jaxdp's GPU step against a hand-written one, and XLA's attention against cuDNN's.

``bin/jaxdp bench --only gpu`` measured jaxdp's fused step at 0.64x torch.compile's
tokens/s on an H100. Two questions this answers, each in the same process and the same
model (``benchmarks/harness/gpu.py``'s GPT-2 small, bf16, micro-batch 16 x 1024, K=8):

- does jaxdp cost anything over a hand-written ``jax.jit`` step that does the same
  (``lax.scan`` over the K micro-batches, float32 gradient sums, AdamW)? ``hand`` vs ``jaxdp``;
- how much is the attention? ``jax.nn.dot_product_attention``'s default
  (``implementation=None``) is XLA's, which writes the T x T scores; torch's
  ``scaled_dot_product_attention`` runs flash attention. ``*_cudnn`` use cuDNN's.

    python3 benchmarks/studies/gpu_floor.py --out DIR     # a GPU machine; writes DIR/gpu_floor.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import gpu  # noqa: E402


def hand_step(cfg: gpu.GPTConfig, micro: int, k: int, attention: str | None) -> Any:
    """The same update as jaxdp's fused step on one device, written by hand."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    model = gpu.nnx_model(cfg, dtype=jnp.bfloat16, attention=attention)
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = optax.adamw(3e-4, weight_decay=0.1)
    opt_state = optimizer.init(params)

    def loss(params: Any, x: Any, y: Any) -> Any:
        return gpu.nnx_loss(nnx.merge(graphdef, params), (x, y))

    @jax.jit
    def step(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
        xs, ys = x.reshape(k, micro, -1), y.reshape(k, micro, -1)

        def one(acc: Any, xy: Any) -> Any:
            value, g = jax.value_and_grad(loss)(params, *xy)
            return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g), value

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        sums, values = jax.lax.scan(one, zeros, (xs, ys))
        grads = jax.tree.map(lambda s: s / k, sums)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, values.mean()

    step = jax.jit(step, donate_argnums=(0, 1))
    x, y = (jax.device_put(a) for a in gpu.batch(cfg, micro * k))
    box = [params, opt_state]

    def run() -> Any:
        box[0], box[1], value = step(box[0], box[1], x, y)
        return value

    return run


def jaxdp_step(cfg: gpu.GPTConfig, micro: int, k: int, attention: str | None) -> Any:
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdp import data_mesh, make_train_step

    mesh = data_mesh(1)
    step = make_train_step(
        gpu.nnx_loss, optax.adamw(3e-4, weight_decay=0.1), mesh=mesh, accum_steps=k
    )
    box = [step.init(gpu.nnx_model(cfg, dtype=jnp.bfloat16, attention=attention))]
    data = jax.device_put(gpu.batch(cfg, micro * k), NamedSharding(mesh, P(mesh.axis_names[0])))

    def run() -> Any:
        box[0], metrics = step(box[0], data)
        return metrics["loss"]

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="toy sizes, XLA attention only: a check")
    args = p.parse_args(argv)
    import jax

    cfg = gpu.TINY if args.tiny else gpu.GPT2_SMALL
    micro, k = (2, 2) if args.tiny else (16, 8)
    repeats, calls = (1, 1) if args.tiny else (5, 3)
    attentions = (None,) if args.tiny else (None, "cudnn")
    tokens = micro * k * cfg.block_size
    result: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    result["tokens_per_step"] = tokens
    for attention in attentions:
        for name, build in (("jaxdp", jaxdp_step), ("hand", hand_step)):
            label = f"{name}_{attention or 'xla'}"
            t0 = time.perf_counter()
            run = build(cfg, micro, k, attention)
            seconds = gpu._timed(run, jax.block_until_ready, warmup=3, repeats=repeats, calls=calls)
            step = sorted(seconds)[len(seconds) // 2]
            result[label] = {
                "step_seconds": step,
                "seconds": seconds,
                "tokens_per_second": tokens / step,
                "wall_seconds": time.perf_counter() - t0,
            }
            print(label, f"{1e3 * step:.1f} ms", f"{tokens / step:,.0f} tokens/s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_floor.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

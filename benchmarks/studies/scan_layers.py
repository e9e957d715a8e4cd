"""The layer loop's price on one device (issue 32's GPU check, before stage 3 exists).

A GPT-2-small-sized model whose blocks are stacked on a leading layer axis, trained one
AdamW step per call inside ``shard_map`` on a one-device mesh, two ways:

- ``scanned``: ``lax.scan`` over the layers, each layer's leaves gathered inside the loop
  body (``all_gather`` over the mesh axis, as stage 3 will gather a layer's shard) under
  ``jax.checkpoint(policy=nothing_saveable)``: no gathered weight is kept for the backward,
  so the backward re-runs each layer's forward (the price of the per-layer peak);
- ``unrolled``: the same blocks in a Python loop, every layer gathered once, no remat
  (what a replicated stage 0-2 step does).

Each variant runs in a process of its own (the allocator's peak is per process). Per
variant: the median step time, XLA's ``memory_analysis()`` of the compiled step against the
allocator's ``peak_bytes_in_use``, and the compiled program's structure (while loops, and
the collectives inside and outside their bodies); the scanned step's optimized HLO is
written beside the results. On one device the gathers move nothing (XLA may drop them):
this measures the loop and the remat, not the wire.

The same model through jaxdp's own step (``jaxdp.make_train_step``, fused, K=1), two more
ways: ``jaxdp_stage3`` (``Parallel(zero_stage=3)``, the blocks looped over by
:func:`jaxdp.scan_layers`: what stage 3 runs, its gather ``custom_vjp`` and remat) and
``jaxdp_stage0`` (stage 0, the blocks in a Python loop, no remat), and
``jaxdp_stage0_scanned`` (stage 0 through :func:`jaxdp.scan_layers`: a plain
``lax.scan``, no remat). Stage 3's optimized HLO is written as
``scan_layers_jaxdp_stage3.hlo.txt``.

    python benchmarks/studies/scan_layers.py --out DIR            # both variants
    python benchmarks/studies/scan_layers.py --out DIR --tiny     # toy sizes, any machine
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout, for benchmarks.harness.gpu's configs

from benchmarks.harness.gpu import GPT2_SMALL, TINY, GPTConfig  # noqa: E402

# Each in a process of its own; the ratios' (numerator, denominator).
VARIANTS = ("unrolled", "scanned", "jaxdp_stage0", "jaxdp_stage0_scanned", "jaxdp_stage3")
RATIOS = {
    "scanned_over_unrolled": ("scanned", "unrolled"),
    "jaxdp_stage3_over_stage0": ("jaxdp_stage3", "jaxdp_stage0"),
    "jaxdp_stage3_over_scanned": ("jaxdp_stage3", "scanned"),
    "jaxdp_stage0_scanned_over_stage0": ("jaxdp_stage0_scanned", "jaxdp_stage0"),
}


def init(cfg: GPTConfig, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """(root leaves, stacked layer leaves), float32, GPT-2's initialization scale."""
    import jax
    import jax.numpy as jnp

    d, n, v, t = cfg.d_model, cfg.n_layer, cfg.vocab_size, cfg.block_size
    shapes = {
        "ln1_scale": (n, d),
        "ln1_bias": (n, d),
        "qkv_w": (n, d, 3 * d),
        "qkv_b": (n, 3 * d),
        "proj_w": (n, d, d),
        "proj_b": (n, d),
        "ln2_scale": (n, d),
        "ln2_bias": (n, d),
        "fc_w": (n, d, 4 * d),
        "fc_b": (n, 4 * d),
        "fcp_w": (n, 4 * d, d),
        "fcp_b": (n, d),
    }
    keys = iter(jax.random.split(jax.random.key(seed), 16))

    def leaf(name: str, shape: tuple[int, ...]) -> Any:
        if name.endswith("_scale"):
            return jnp.ones(shape, jnp.float32)
        if name.endswith(("_b", "_bias")):
            return jnp.zeros(shape, jnp.float32)
        return 0.02 * jax.random.normal(next(keys), shape, jnp.float32)

    layers = {name: leaf(name, shape) for name, shape in shapes.items()}
    root = {
        "wte": leaf("wte", (v, d)),
        "wpe": leaf("wpe", (t, d)),
        "lnf_scale": jnp.ones((d,), jnp.float32),
        "lnf_bias": jnp.zeros((d,), jnp.float32),
    }
    return root, layers


def _layer_norm(x: Any, scale: Any, bias: Any) -> Any:
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) * (var + 1e-5) ** -0.5 * scale + bias).astype(x.dtype)


def block(p: dict[str, Any], x: Any, n_head: int) -> Any:
    import jax
    import jax.numpy as jnp

    p = {k: v.astype(jnp.bfloat16) for k, v in p.items()}
    b, t, d = x.shape
    q, k, v = jnp.split(
        _layer_norm(x, p["ln1_scale"], p["ln1_bias"]) @ p["qkv_w"] + p["qkv_b"], 3, -1
    )
    q, k, v = (y.reshape(b, t, n_head, d // n_head) for y in (q, k, v))
    att = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + att.reshape(b, t, d) @ p["proj_w"] + p["proj_b"]
    h = _layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    return x + jax.nn.gelu(h @ p["fc_w"] + p["fc_b"], approximate=True) @ p["fcp_w"] + p["fcp_b"]


def embed(root: dict[str, Any], tokens: Any) -> Any:
    import jax.numpy as jnp

    return (root["wte"][tokens] + root["wpe"][: tokens.shape[1]]).astype(jnp.bfloat16)


def head_loss(root: dict[str, Any], x: Any, targets: Any) -> Any:
    """The final norm, the tied head and the mean cross-entropy."""
    import jax.numpy as jnp
    import optax

    x = _layer_norm(x, root["lnf_scale"], root["lnf_bias"])
    logits = (x @ root["wte"].astype(jnp.bfloat16).T).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_step(cfg: GPTConfig, variant: str, mesh: Any) -> Any:
    """One AdamW step inside ``shard_map``; layer leaves at rest split along their last
    dimension (never the layer axis), gathered per layer (scanned) or all at once (unrolled)."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    axis = mesh.axis_names[0]
    optimizer = optax.adamw(3e-4, weight_decay=0.1)

    def gather(tree: Any, dim: int) -> Any:
        return jax.tree.map(
            lambda a: jax.lax.all_gather(a, axis, axis=a.ndim - 1, tiled=True), tree
        )

    def loss(params: Any, tokens: Any, targets: Any) -> Any:
        root, layers = params
        root = gather(root, -1)  # the root group: gathered once, kept through the backward
        x = embed(root, tokens)
        if variant == "scanned":

            @partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
            def body(x: Any, layer: Any) -> tuple[Any, None]:
                return block(gather(layer, -1), x, cfg.n_head), None

            x, _ = jax.lax.scan(body, x, layers)
        else:
            full = gather(layers, -1)
            for i in range(cfg.n_layer):
                x = block(jax.tree.map(lambda a, i=i: a[i], full), x, cfg.n_head)
        return head_loss(root, x, targets)

    def device_step(params: Any, opt_state: Any, tokens: Any, targets: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(value, axis)

    def spec(a: Any) -> Any:  # the last dimension split over the mesh axis
        return P(*([None] * (a.ndim - 1)), axis)

    def build(params: Any) -> tuple[Any, Any]:
        opt_state = optimizer.init(params)
        specs = jax.tree.map(spec, params)
        opt_specs = jax.tree.map(lambda a: spec(a) if a.ndim else P(), opt_state)
        mapped = jax.shard_map(
            device_step,
            mesh=mesh,
            in_specs=(specs, opt_specs, P(axis), P(axis)),
            out_specs=(specs, opt_specs, P()),
            check_vma=False,
        )
        return jax.jit(mapped, donate_argnums=(0, 1)), opt_state

    return build


def make_jaxdp_step(cfg: GPTConfig, variant: str, mesh: Any) -> Any:
    """jaxdp's fused step (K=1) for the same model: stage 3 with :func:`jaxdp.scan_layers`,
    or stage 0 with the blocks unrolled; params ``{"root": ..., "layers": ...}``."""
    import optax

    import jaxdp

    def loss(params: Any, batch: Any) -> Any:
        tokens, targets = batch
        root, layers = params["root"], params["layers"]
        x = embed(root, tokens)
        if variant in ("jaxdp_stage3", "jaxdp_stage0_scanned"):
            x = jaxdp.scan_layers(lambda layer, x: block(layer, x, cfg.n_head), layers, x)
        else:
            for i in range(cfg.n_layer):
                x = block({k: a[i] for k, a in layers.items()}, x, cfg.n_head)
        return head_loss(root, x, targets)

    stage = 3 if variant == "jaxdp_stage3" else 0
    return jaxdp.make_train_step(
        loss,
        optax.adamw(3e-4, weight_decay=0.1),
        mesh=mesh,
        # The stack declared at stage 3 (gathered a layer at a time); at stage 0 it stays
        # the plain loop (the plain spelling would send each layer's gradient from it).
        parallel=jaxdp.Parallel(zero_stage=stage, layers=("layers",) if stage == 3 else None),
    )


def _program(text: str) -> dict[str, Any]:
    """While loops and collectives in an optimized HLO module, inside and outside loop bodies."""
    computations = re.split(r"\n(?=\S[^\n]*\{\n)", text)
    bodies = set(re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", text))
    found: dict[str, Any] = {"while_loops": len(re.findall(r"= [^\n]*\bwhile\(", text))}
    for op in ("all-gather", "reduce-scatter", "all-reduce"):
        inside = outside = 0
        for comp in computations:
            name = re.match(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)", comp)
            count = len(re.findall(rf"\b{op}(?:-start)?\(", comp))
            if name and name.group(1) in bodies:
                inside += count
            else:
                outside += count
        found[op] = {"in_loop_bodies": inside, "outside": outside}
    return found


def run_variant(
    cfg: GPTConfig, variant: str, rows: int, repeats: int, calls: int, out: Path
) -> dict:
    import jax
    import numpy as np

    from jaxdp import data_mesh

    mesh = data_mesh(1)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, size=(rows, cfg.block_size + 1)).astype(np.int32)
    started = time.perf_counter()
    if variant.startswith("jaxdp"):
        train_step = make_jaxdp_step(cfg, variant, mesh)
        root, layers = init(cfg)
        state = train_step.init({"root": root, "layers": layers})
        batch = (tokens[:, :-1], tokens[:, 1:])
        compiled = train_step.compile(state, batch)
        box: list[Any] = [state]

        def once() -> Any:
            box[0], metrics = train_step(box[0], batch)
            return metrics["loss"]

    else:
        params = init(cfg)
        step, opt_state = make_step(cfg, variant, mesh)(params)
        x, y = jax.device_put(tokens[:, :-1]), jax.device_put(tokens[:, 1:])
        compiled = step.lower(params, opt_state, x, y).compile()
        box = [params, opt_state]

        def once() -> Any:
            box[0], box[1], value = compiled(box[0], box[1], x, y)
            return value

    compile_s = time.perf_counter() - started
    text = compiled.as_text()
    if variant in ("scanned", "jaxdp_stage3"):
        (out / f"scan_layers_{variant}.hlo.txt").write_text(text)
    m = compiled.memory_analysis()
    analysis = {
        k: int(getattr(m, k))
        for k in (
            "temp_size_in_bytes",
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "alias_size_in_bytes",
        )
        if m is not None and hasattr(m, k)
    }
    for _ in range(3):
        jax.block_until_ready(once())
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            value = once()
        jax.block_until_ready(value)
        samples.append((time.perf_counter() - t0) / calls)
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "variant": variant,
        "compile_seconds": compile_s,
        "step_seconds": float(np.median(samples)),
        "seconds": samples,
        "loss": float(value),
        "memory_analysis": analysis,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "program": _program(text),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="toy sizes on any device: a check only")
    p.add_argument("--variant", choices=VARIANTS, help="one, in this process")
    p.add_argument("--rows", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--timeout-s", type=float, default=None)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = TINY if args.tiny else GPT2_SMALL
    repeats, calls = (1, 1) if args.tiny else (5, 3)
    if args.variant:
        result = run_variant(
            cfg, args.variant, 2 if args.tiny else args.rows, repeats, calls, args.out
        )
        (args.out / f"scan_layers_{args.variant}.json").write_text(
            json.dumps(result, indent=1) + "\n"
        )
        return 0
    results = {}
    for variant in VARIANTS:  # each in a fresh process: its own allocator peak
        argv = [sys.executable, __file__, "--out", str(args.out), "--variant", variant]
        argv += ["--rows", str(args.rows)] + ["--tiny"] * args.tiny
        subprocess.run(argv, check=True, timeout=args.timeout_s)
        path = args.out / f"scan_layers_{variant}.json"
        results[variant] = json.loads(path.read_text())
        path.unlink()
    for name, (over, under) in RATIOS.items():
        s, u = results[over], results[under]
        results[name] = {
            "step_time": s["step_seconds"] / u["step_seconds"],
            "temp_bytes": s["memory_analysis"].get("temp_size_in_bytes", 0)
            / max(u["memory_analysis"].get("temp_size_in_bytes", 1), 1),
        }
    (args.out / "scan_layers.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({name: results[name] for name in RATIOS}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

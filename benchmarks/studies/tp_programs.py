"""Tensor parallelism on many GPUs, read from the compiled program (issue 49, item 5):
GPT-2 small with its Megatron plan (``benchmarks.harness.gpu.nnx_model(tp=True)``) trained
by jaxdp on a ``(data, model)`` mesh (``Parallel(model_axes=("model",))``), compiled by
XLA:GPU for H100 topologies on a CPU machine (``jaxdp.testing.gpu_mesh``), fused, K = 4.

Run from a checkout (jax's CUDA plugin: ``.venv-newest``)::

    JAX_PLATFORMS=cpu .venv-newest/bin/python benchmarks/studies/tp_programs.py \
        [--cells 1x1x8:2 1x1x8:4 1x1x8:8 1x2x8:8] [--stage 0] [--layers 12] [--out FILE.json]

Prints one JSON line per cell (``topology:model``; the model axis within a host, the
devices of a host consecutive): the gradients' collectives over the data groups (their
count, bytes, how many run in the micro-batch loop, the share of their bytes with a
matrix product under them, and that share leaving out the tied token embedding, which
the plan keeps whole and whose gradient completes at the backward's end), the model
groups' collectives (Megatron's all-reduces, XLA's), any collective over other groups,
the replica groups' spellings, the parameters' bytes per device and XLA's peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout


def program(topology: str, model_size: int, *, stage: int = 0, layers: int = 12, k: int = 4):
    """``(compiled, abstract state, batch, mesh, compile CPU s)`` of the cell: GPT-2 small
    (``layers`` blocks) with its Megatron plan on the ``(data, model)`` mesh of
    ``topology``'s GPUs, the model axis of ``model_size`` within a host."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import AxisType, Mesh

    import jaxdp
    from benchmarks.harness import gpu
    from jaxdp.testing import gpu_mesh

    cfg = dataclasses.replace(gpu.GPT2_SMALL, n_layer=layers)
    with jax.enable_x64(False):  # as a user's script runs: jax's default 32-bit types
        devices = np.array(gpu_mesh(topology).devices).reshape(-1, model_size)
        mesh = Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        step = jaxdp.make_train_step(
            gpu.nnx_loss,
            optax.adamw(3e-4, weight_decay=0.1),
            mesh=mesh,
            accum_steps=k,
            parallel=jaxdp.Parallel(zero_stage=stage, model_axes=("model",)),
        )
        model = nnx.eval_shape(lambda: gpu.nnx_model(cfg, dtype=jnp.bfloat16, tp=True))
        state = step.abstract_state(model)
        rows = devices.shape[0] * k * 8  # 8 sequences per micro-batch and data rank
        batch = (jax.ShapeDtypeStruct((rows, cfg.block_size), jnp.int32),) * 2
        start = time.process_time()
        compiled = step.compile(state, batch)
        seconds = time.process_time() - start
    return compiled, state, batch, mesh, seconds


def mesh_groups(mesh) -> tuple[frozenset, frozenset]:
    """``(data groups, model groups)`` of a ``(data, model)`` mesh as a compiled program's
    replica groups name them (``Collective.groups``): each device by its place in the
    mesh, a data group a column, a model group a row."""
    import numpy as np

    places = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    return frozenset(map(tuple, places.T.tolist())), frozenset(map(tuple, places.tolist()))


def per_device(tree) -> int:
    """Bytes one device holds of ``tree``'s abstract leaves, by their shardings."""
    import jax

    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def measure(topology: str, model_size: int, *, stage: int, layers: int, k: int = 4) -> dict:
    from jaxdp.plan import compiled_memory
    from jaxdp.testing import collectives

    compiled, state, _, mesh, seconds = program(
        topology, model_size, stage=stage, layers=layers, k=k
    )
    found, (data, model) = collectives(compiled), mesh_groups(mesh)
    kind = "all-reduce" if stage == 0 else "reduce-scatter"
    grads = [c for c in found if c.groups == data and c.kind == kind]
    tied = math.prod(state.params["wte"]["embedding"].shape) * 4

    def shares(cs: list) -> dict:
        total = sum(c.bytes for c in cs)
        hidden = sum(c.bytes for c in cs if c.overlapped)
        return {
            "count": len(cs),
            "bytes": total,
            "in_loop": sum(c.in_loop for c in cs),
            "hidden": round(hidden / total, 3) if total else None,
        }

    rest = [c for c in grads if c.bytes < tied]
    memory = compiled_memory(compiled)
    return {
        "cell": f"{topology}:{model_size}",
        "data x model": " x ".join(map(str, mesh.devices.shape)),
        "stage": stage,
        "layers": layers,
        "K": k,
        "compile_cpu_s": round(seconds, 1),
        "data_gradients": shares(grads),
        "data_gradients_but_the_tied_embedding": shares(rest),
        "model_groups": {
            kind: shares([c for c in found if c.groups == model and c.kind == kind])
            for kind in sorted({c.kind for c in found if c.groups == model})
        },
        "other_groups": sorted(
            {(c.kind, c.devices) for c in found if c.groups not in (data, model)}
        ),
        "replica_groups": sorted(set(re.findall(r"replica_groups=(\S+?),? ", compiled.as_text()))),
        "param_bytes_per_device": per_device(state.params),
        "peak_gib": round(memory.peak / 2**30, 2) if memory.peak else None,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", nargs="+", default=["1x1x8:2", "1x1x8:4", "1x1x8:8", "1x2x8:8"])
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--out", type=pathlib.Path)
    args = p.parse_args(argv)
    out = []
    for cell in args.cells:
        topology, size = cell.split(":")
        out.append(measure(topology, int(size), stage=args.stage, layers=args.layers))
        print(json.dumps(out[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

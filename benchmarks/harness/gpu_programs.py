"""GPU programs read without a GPU: jaxdp's step for GPT-2 small compiled by XLA:GPU for
one node of 8 H100s and two nodes of 8 (:func:`jaxdp.testing.gpu_mesh`), per ZeRO stage,
path and K: its gradient collectives, their bytes, the share of those bytes with a matrix
product scheduled under them, and each device's peak memory beside ``jaxdp plan``'s.

Nothing runs: each program is compiled from abstract inputs (``step.abstract_state``),
on a CPU machine, with the newest jax and its CUDA plugin (``bin/jaxdp bench --only
gpu_programs`` sets up ``.venv-newest`` with ``bin/test-newest-jax --setup-only`` and runs
this module there; by hand: ``JAX_PLATFORMS=cpu .venv-newest/bin/python -m
benchmarks.harness.gpu_programs --out DIR``). Deterministic: the figures are the
compiler's, not timings.

The model and batch are tests/gpu's (:mod:`benchmarks.harness.gpu`'s GPT-2 small, bf16
compute over float32 parameters, AdamW, 8 sequences of 1024 tokens per micro-batch and
device). "hidden" is the share of the gradient collectives' bytes in asynchronous
collectives with a matrix product between start and done, of all of them and of those
but the tied token embedding's (whose gradient is complete only at the backward's end).
The plan's figure is :func:`jaxdp.plan.plan_memory` for the same sizes (float32
weights, gradients and AdamW moments, the float32 accumulator, the per-device batch, and
one micro-batch's activations as the planner measures them: the residuals JAX's autodiff
keeps, from an abstract trace).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import Any

from ._common import standard_args, write_result
from .gpu import GPT2_SMALL, TINY, GPTConfig, nnx_loss, nnx_model

TOPOLOGIES = ("1x1x8", "1x2x8")
# (zero_stage, path, accum_steps), as tests/gpu/test_gpu_programs.py compiles them.
CELLS = (
    (0, "fused", 1),
    (0, "fused", 4),
    (0, "multisteps", 4),
    (1, "fused", 1),
    (1, "fused", 4),
    (2, "fused", 1),
    (2, "fused", 4),
)
MICRO_BATCH_SIZE = 8
QUICK_CELLS = ((0, "fused", 2),)


def compile_cell(cfg: GPTConfig, topology: str, stage: int, path: str, k: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxdp
    from jaxdp.plan import compiled_memory
    from jaxdp.testing import collectives, gpu_mesh

    mesh = gpu_mesh(topology)
    step = jaxdp.make_train_step(
        nnx_loss,
        optax.adamw(3e-4, weight_decay=0.1),
        mesh=mesh,
        accum_steps=k,
        path=path,
        parallel=jaxdp.Parallel(zero_stage=stage),
    )
    state = step.abstract_state(nnx.eval_shape(lambda: nnx_model(cfg, dtype=jnp.bfloat16)))
    rows = mesh.size * (k if path == "fused" else 1) * MICRO_BATCH_SIZE
    batch = (jax.ShapeDtypeStruct((rows, cfg.block_size), jnp.int32),) * 2
    started = time.perf_counter()
    compiled = step.compile(state, batch)
    seconds = time.perf_counter() - started
    kind = "all-reduce" if stage == 0 else "reduce-scatter"
    found = collectives(compiled)
    branch = path == "multisteps"  # the window's last call: its branch's collectives
    grads = [c for c in found if c.kind == kind and c.bytes > 2**16]
    gathers = [c for c in found if c.kind == "all-gather"]

    def runs(c: Any) -> int:
        return c.executions[1] if branch else c.executions[0]

    carried = sum(c.bytes * runs(c) for c in grads)
    hidden = sum(c.bytes * runs(c) for c in grads if c.overlapped)
    # The tied embedding's reduction is larger than any bucket: it travels alone.
    tied = _nbytes(state.params["wte"])
    untied = [c for c in grads if c.bytes < tied]
    rest = sum(c.bytes * runs(c) for c in untied)
    rest_hidden = sum(c.bytes * runs(c) for c in untied if c.overlapped)
    memory = compiled_memory(compiled)
    return {
        "topology": topology,
        "devices": mesh.size,
        "zero_stage": stage,
        "path": path,
        "accum_steps": k,
        "compile_seconds": seconds,
        "gradient_kind": kind,
        "gradient_collectives": sum(runs(c) for c in grads),
        "gradient_bytes": carried,
        "in_loop": sum(1 for c in grads if c.in_loop),
        "hidden_share": hidden / carried if carried else 0.0,
        "hidden_share_but_tied": rest_hidden / rest if rest else 0.0,
        "tied_hidden": all(c.overlapped for c in grads if c.bytes >= tied),
        "largest_bucket": max((c.bytes for c in grads), default=0),
        "all_gathers": sum(runs(c) for c in gathers),
        "all_gather_bytes": sum(c.bytes * runs(c) for c in gathers),
        "memory": dataclasses.asdict(memory),
        "plan_bytes": _plan_bytes(cfg, state, mesh.size, stage, k),
    }


def _nbytes(tree: Any) -> int:
    import jax

    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _plan_bytes(cfg: GPTConfig, state: Any, devices: int, stage: int, k: int) -> float:
    """``jaxdp plan``'s per-device total for the compiled sizes."""
    from jaxdp.plan import plan_memory

    params = _nbytes(state.params) // 4
    plan = plan_memory(
        params=params,
        policy="fp32",
        optimizer="adamw",
        num_devices=devices,
        zero_stage=stage,
        activation_bytes_per_sample=_activation_bytes_per_sample(cfg),
        input_bytes_per_sample=2 * 4 * cfg.block_size,
    )
    return dataclasses.replace(plan, micro_batch_size=MICRO_BATCH_SIZE, accum_steps=k).total


def _activation_bytes_per_sample(cfg: GPTConfig) -> float:
    """What the planner counts per sample: the residuals of ``jax.vjp`` of the loss, at
    two micro-batch sizes (:func:`jaxdp.plan._xla.activation_bytes_per_sample`'s way)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, params, rest = nnx.split(
        nnx.eval_shape(lambda: nnx_model(cfg, dtype=jnp.bfloat16)), nnx.Param, ...
    )

    def residuals(params: Any, rows: int) -> int:
        tokens = jax.ShapeDtypeStruct((rows, cfg.block_size), jnp.int32)

        def loss(p: Any, x: Any) -> Any:
            return nnx_loss(nnx.merge(graphdef, p, rest), (x, x))

        shapes = jax.eval_shape(lambda p, x: jax.vjp(lambda q: loss(q, x), p)[1], params, tokens)
        return _nbytes(shapes)

    return (residuals(params, 2) - residuals(params, 1)) / 1


def stage_3_plan_bytes(
    make: Any,
    loss: Any,
    state: Any,
    *,
    num_devices: int,
    micro: int,
    k: int,
    remat: Any,
    shards: int | None = None,
) -> float:
    """``jaxdp plan``'s per-device total for a stage-3 step of a
    :class:`jaxdp.models.ScannedTransformer` (``make()`` builds it, ``state`` is the step's
    abstract state) at the step's ``remat`` (a name or a ``jax.checkpoint_policies``
    policy), for ``micro`` rows per micro-batch and ``k`` micro-batches.

    The activations per sample are the planner's measure, the residuals JAX's autodiff
    keeps (from abstract traces at one and two rows), with ``scan_layers``' loop under the
    remat's policy as the step runs it. ``"full"`` plans ``remat="full"`` from every
    activation ``A``, one layer's share ``a`` and its input ``c`` (the carry, ``block_size
    x d_model`` in the compute dtype): the root group's activations are what nothing kept
    leaves beside the ``L`` carries. Any other policy plans its own residuals."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxdp.plan import activation_bytes, plan_memory

    module = nnx.eval_shape(make)
    _, params, _ = nnx.split(module, nnx.Param, ...)
    layers = jax.tree.leaves(params["blocks"])[0].shape[0]
    tokens, width = params["pos_emb"]["embedding"].shape
    row = (jax.ShapeDtypeStruct((1, tokens), jnp.int32),) * 2

    def per_sample(policy: Any) -> float:
        """The residuals one more row adds, the layer loop under ``policy``."""
        return activation_bytes(loss, module, row, remat=policy)

    weights = _nbytes(params) // 4  # float32 parameters
    common = dict(
        params=weights,
        policy="fp32",
        optimizer="adamw",
        num_devices=num_devices,
        shards=shards,
        zero_stage=3,
        layers=layers,
        root_params=weights - _nbytes(params["blocks"]) // 4,
        input_bytes_per_sample=2 * 4 * tokens,
    )
    policies = jax.checkpoint_policies
    if remat == "full" or remat is policies.nothing_saveable:
        every = per_sample(policies.everything_saveable)
        carry = tokens * width * jnp.dtype(module.dtype or jnp.float32).itemsize
        root = per_sample(policies.nothing_saveable) - layers * carry
        plan = plan_memory(
            **common,
            remat="full",
            activation_bytes_per_sample=every,
            layer_activation_bytes_per_sample=(every - root) / layers,
            carry_bytes_per_sample=carry,
        )
    else:
        policy = policies.dots_saveable if remat == "dots" else remat
        plan = plan_memory(**common, remat="dots", activation_bytes_per_sample=per_sample(policy))
    return dataclasses.replace(plan, micro_batch_size=micro, accum_steps=k).total


# Stage 3 and HSDP: a scanned GPT-2-small-sized model, as tests/gpu/test_gpu_stage3.py.
STAGE_3_SIZES = {"vocab_size": 50304, "block_size": 1024, "d_model": 768, "n_heads": 12}
STAGE_3_CELLS = (
    ("1x1x8", None, 1, "dots"),
    ("1x1x8", None, 4, "dots"),
    ("1x1x8", None, 1, "full"),
    ("1x1x8", None, 1, "dots_with_no_batch_dims_saveable"),
    ("1x2x8", 8, 1, "dots"),
    ("1x2x8", 8, 4, "dots"),
    ("1x16x8", 8, 1, "dots"),
    ("1x128x8", 8, 1, "dots"),
    # Plain stage 3 over every device at scale: its leaves padded where 1,024 divides none
    # of their dimensions (FSDP2's rule), none left to an all-reduce.
    ("1x16x8", None, 1, "dots"),
    ("1x128x8", None, 1, "dots"),
    # HSDP's all-reduce across the replica groups once after the backward, not per layer
    ("1x2x8", 8, 1, "dots", "after_backward"),
    ("1x2x8", 8, 4, "dots", "after_backward"),
)


def no_stack(path: str, leaf: Any) -> bool:
    """``Parallel.layers`` that declares no leaf a stack: the scanned model as a step not
    told of its stack sees it (its own metadata declares it): the "undeclared" rows."""
    return False


def stage_3_model(layers: int = 12) -> Any:
    import jax.numpy as jnp
    from flax import nnx

    import jaxdp

    return jaxdp.models.ScannedTransformer(
        **STAGE_3_SIZES, n_layers=layers, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
    )


def stage_3_loss(model: Any, batch: Any) -> Any:
    import jax.numpy as jnp
    import optax

    x, y = batch
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def stage_3_step(
    topology: str,
    shards: int | None,
    k: int,
    remat: str = "dots",
    layers: int = 12,
    replica_all_reduce: str = "per_layer",
) -> tuple[Any, Any, Any]:
    """``(step, abstract state, abstract batch)`` of a stage-3 cell (HSDP with ``shards``)
    for the scanned model, its blocks a stack by its own metadata, as
    tests/gpu/test_gpu_stage3.py and this benchmark compile it; ``replica_all_reduce``:
    ``Parallel``'s (HSDP)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxdp
    from jaxdp.testing import gpu_mesh

    mesh = gpu_mesh(topology)
    step = jaxdp.make_train_step(
        stage_3_loss,
        optax.adamw(3e-4, weight_decay=0.1),
        mesh=mesh,
        accum_steps=k,
        parallel=jaxdp.Parallel(
            zero_stage=3,
            shards=shards,
            remat=getattr(jax.checkpoint_policies, remat, remat),
            **({"replica_all_reduce": replica_all_reduce} if shards else {}),
        ),
    )
    state = step.abstract_state(nnx.eval_shape(functools.partial(stage_3_model, layers)))
    rows = mesh.size * k * MICRO_BATCH_SIZE
    batch = (jax.ShapeDtypeStruct((rows, STAGE_3_SIZES["block_size"]), jnp.int32),) * 2
    return step, state, batch


def compile_scanned_cell(
    topology: str, stage: int, path: str, k: int, *, layers: Any = None
) -> tuple[Any, Any]:
    """``(compiled, abstract state)`` of the scanned GPT-2-small-sized model at ZeRO
    ``stage`` 0 to 2, its blocks a stack of layers by its metadata, or as ``layers``
    says (``Parallel(layers=...)``; :func:`no_stack`: none): each declared layer's
    gradients leave the backward as the layer ends. As this benchmark compiles it."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxdp
    from jaxdp.testing import gpu_mesh

    mesh = gpu_mesh(topology)
    step = jaxdp.make_train_step(
        stage_3_loss,
        optax.adamw(3e-4, weight_decay=0.1),
        mesh=mesh,
        accum_steps=k,
        path=path,
        parallel=jaxdp.Parallel(zero_stage=stage, layers=layers),
    )
    state = step.abstract_state(nnx.eval_shape(stage_3_model))
    rows = mesh.size * (k if path == "fused" else 1) * MICRO_BATCH_SIZE
    batch = (jax.ShapeDtypeStruct((rows, STAGE_3_SIZES["block_size"]), jnp.int32),) * 2
    return step.compile(state, batch), state


def scanned_row(topology: str, stage: int, path: str, k: int, layers: Any) -> dict[str, Any]:
    """The gradient collectives' hidden share of :func:`compile_scanned_cell`'s program,
    of all the bytes and of those but the two embedding-sized leaves' (the token
    embedding's, complete at the backward's end, and the untied head's)."""
    from jaxdp.testing import collectives

    started = time.perf_counter()
    compiled, state = compile_scanned_cell(topology, stage, path, k, layers=layers)
    seconds = time.perf_counter() - started
    kind = "all-reduce" if stage == 0 else "reduce-scatter"
    branch = path == "multisteps"
    grads = [c for c in collectives(compiled) if c.kind == kind and c.bytes > 2**16]
    embedding = _nbytes(state.params["tok_emb"])

    def share(cs: list[Any]) -> float:
        runs = [c.executions[1] if branch else c.executions[0] for c in cs]
        total = sum(c.bytes * r for c, r in zip(cs, runs, strict=True))
        hidden = sum(c.bytes * r for c, r in zip(cs, runs, strict=True) if c.overlapped)
        return hidden / total if total else 0.0

    return {
        "topology": topology,
        "zero_stage": stage,
        "path": path,
        "accum_steps": k,
        "declared": layers is not no_stack,
        "compile_seconds": seconds,
        "gradient_collectives": len(grads),
        "hidden_share": share(grads),
        "hidden_share_but_embeddings": share([c for c in grads if c.bytes < embedding]),
    }


def stage_3_first_and_last(state: Any) -> set[int]:
    """The sizes of each micro-batch's first gathers and last reduce-scatters, which have
    nothing to hide under: the token embedding's and a block's, whole in float32 (the
    layer loop moves a block in bfloat16). The untied head's reduce-scatter, of the token
    embedding's size, is left out with them (it hides)."""
    import jax

    layers = jax.tree.leaves(state.params["blocks"])[0].shape[0]
    return {_nbytes(state.params["tok_emb"]), _nbytes(state.params["blocks"]) // layers}


def compile_stage_3_cell(
    topology: str,
    shards: int | None,
    k: int,
    remat: str,
    replica_all_reduce: str = "per_layer",
    *,
    layers: int = 12,
) -> dict[str, Any]:
    import jax

    from jaxdp.plan import compiled_memory
    from jaxdp.testing import collectives, instructions

    step, state, batch = stage_3_step(
        topology, shards, k, remat, layers, replica_all_reduce=replica_all_reduce
    )
    mesh = step.options.mesh
    started = time.perf_counter()
    compiled = step.compile(state, batch)
    seconds = time.perf_counter() - started
    found = collectives(compiled)
    first = stage_3_first_and_last(state)
    row: dict[str, Any] = {
        "topology": topology,
        "devices": mesh.size,
        "shards": shards,
        "accum_steps": k,
        "remat": remat,
        "replica_all_reduce": replica_all_reduce if shards else None,
        "compile_seconds": seconds,
    }
    for kind in ("all-gather", "reduce-scatter"):
        of_kind = [c for c in found if c.kind == kind]
        carried = sum(c.bytes * c.executions[0] for c in of_kind)
        hidden = sum(c.bytes * c.executions[0] for c in of_kind if c.overlapped)
        rest = [c for c in of_kind if c.bytes not in first]
        rest_bytes = sum(c.bytes * c.executions[0] for c in rest)
        rest_hidden = sum(c.bytes * c.executions[0] for c in rest if c.overlapped)
        row[kind] = {
            "collectives": sum(c.executions[0] for c in of_kind),
            "bytes": carried,
            "hidden_share": hidden / carried if carried else 0.0,
            "hidden_share_but_first_and_last": rest_hidden / rest_bytes if rest_bytes else 0.0,
        }
    # A gradient all-reduce of more than scalars (64 KiB) is a leaf stage 3 failed to split.
    reduced = [c for c in found if c.kind == "all-reduce"]
    row["largest_all_reduce_bytes"] = max((c.bytes for c in reduced), default=0)
    if shards is not None:  # HSDP: the blocks' all-reduce across the replica groups
        across = [c for c in found if c.kind == "all-reduce" and c.bytes > 2**16]
        block = _nbytes(state.params["tok_emb"]) // shards  # the embedding-sized blocks'
        rest = [c for c in across if c.bytes < block]

        def hidden(cs: list[Any]) -> float:
            carried = sum(c.bytes * c.executions[0] for c in cs)
            return sum(c.bytes * c.executions[0] for c in cs if c.overlapped) / carried

        row["all-reduce"] = {
            "bytes": sum(c.bytes * c.executions[0] for c in across),
            "hidden_share": hidden(across) if across else 0.0,
            "hidden_share_but_embeddings": hidden(rest) if rest else 0.0,
        }
    loops: dict[tuple, int] = {}
    for i in instructions(compiled):
        if i.flops and len(i.context) == 1 and i.context[0].startswith("while"):
            loops[i.context] = loops.get(i.context, 0) + i.flops
    if len(loops) == 2:  # K = 1: the forward's and the backward's layer loops
        forward, backward = sorted(loops.values())
        row["backward_over_forward_flops"] = backward / forward
    row["memory"] = dataclasses.asdict(compiled_memory(compiled))
    row["plan_bytes"] = stage_3_plan_bytes(
        functools.partial(stage_3_model, layers),
        stage_3_loss,
        state,
        num_devices=mesh.size,
        shards=shards,
        micro=MICRO_BATCH_SIZE,
        k=k,
        remat=getattr(jax.checkpoint_policies, remat, remat),
    )
    return row


def main(argv: Sequence[str] | None = None) -> None:
    args = standard_args(__doc__.split("\n")[0], argv)
    cfg, cells, topologies = (
        (TINY, QUICK_CELLS, TOPOLOGIES[:1]) if args.quick else (GPT2_SMALL, CELLS, TOPOLOGIES)
    )
    started = time.perf_counter()
    rows = [compile_cell(cfg, topology, *cell) for topology in topologies for cell in cells]
    stage_3 = [
        compile_stage_3_cell(*cell, layers=2 if args.quick else 12)
        for cell in (STAGE_3_CELLS[:1] if args.quick else STAGE_3_CELLS)
    ]
    # The scanned model at stages 0 to 2, its stack undeclared and declared.
    scanned = [
        scanned_row(topology, *cell, layers)
        for topology in topologies
        for cell in (QUICK_CELLS if args.quick else CELLS)
        for layers in (no_stack, None)
    ]
    result = {
        "quick": args.quick,
        "model": dataclasses.asdict(cfg),
        "micro_batch_size": MICRO_BATCH_SIZE,
        "target": "h100-sxm",
        "bucket_cap_mb": 25,
        "rows": rows,
        "stage_3": stage_3,
        "scanned": scanned,
    }
    write_result(args.out, "gpu_programs", result, started)


if __name__ == "__main__":
    main()

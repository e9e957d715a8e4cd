"""The parity matrix: which (model, optimizer, layout, path, strategy, dtype) cells run.

Every model meets every optimizer, both accumulation paths and both strategies, and
the five layouts in rotation; what only the layout changes is the equivalence grid's.
"""

import dataclasses

from jaxdp.parity import ParityConfig

MODELS = ("linear", "mlp", "cnn", "transformer")
OPTIMIZERS = ("sgd_momentum", "sgd_nesterov_wd", "adamw", "adamw_clip")
LAYOUTS = ((1, 1), (1, 4), (2, 2), (4, 1), (2, 3))  # (num_devices, accum_steps)
STEPS = 10

# Four cells per model, one per optimizer: every model meets every optimizer, both
# paths and both strategies; every optimizer both paths and both strategies; every
# layout both paths; multisteps with several devices AND several micro-batches on both
# strategies. A cell that differed from these only in N x K went (issue 31): that
# "N devices x K micro-batches equals one big batch" is tests/core/test_equivalence.py's
# grid; here what torch could do differently: the model, the optimizer, the path.
FLOAT64 = [
    ParityConfig(
        model=model,
        optimizer=OPTIMIZERS[(m + j) % len(OPTIMIZERS)],
        num_devices=LAYOUTS[(m + j) % len(LAYOUTS)][0],
        accum_steps=LAYOUTS[(m + j) % len(LAYOUTS)][1],
        steps=STEPS,
        dtype="float64",
        path=("fused", "multisteps")[j % 2],
        strategy="pmap" if (m + j // 2) % 2 == 0 else "shard_map",
    )
    for m, model in enumerate(MODELS)
    for j in range(len(OPTIMIZERS))
]

# float32 against PyTorch's assert_equal defaults: each model once on 2 x 2 (shard_map),
# the path and the optimizer alternating, cnn and transformer (convolutions, softmax,
# LayerNorm: where float32 rounds most) on the other path in the pmap cells below; every
# optimizer, both paths and both strategies meet float32. What only the optimizer or the
# path changes, float64 asserts above at 1e-10 (issue 31: 4 cells went, 11 before).
FLOAT32 = [
    ParityConfig(
        model=model,
        optimizer=optimizer,
        num_devices=2,
        accum_steps=2,
        steps=STEPS,
        dtype="float32",
        path=path,
    )
    for model, (optimizer, path) in zip(
        MODELS, [("adamw", "multisteps"), ("sgd_momentum", "fused")] * 2, strict=True
    )
] + [
    # float32 with the other two optimizers, pmap, and other layouts.
    ParityConfig(
        model=model,
        optimizer=optimizer,
        num_devices=n,
        accum_steps=k,
        steps=STEPS,
        dtype="float32",
        path=path,
        strategy="pmap",
    )
    for model, optimizer, (n, k), path in (
        ("mlp", "sgd_nesterov_wd", (2, 3), "fused"),
        ("transformer", "adamw_clip", (4, 1), "multisteps"),
        ("cnn", "adamw_clip", (1, 4), "fused"),
    )
]

# 90 samples: 45 per rank, 11 micro-batches of 4, three windows of 3 and 2 left over.
LAST_WINDOW = [
    ParityConfig(
        model="mlp",
        optimizer="sgd_momentum",
        num_devices=2,
        accum_steps=3,
        num_samples=90,
        steps=STEPS,
        path=path,
        last_window=policy,
    )
    for policy, path in (("drop", "fused"), ("step", "fused"), ("step", "multisteps"))
]

# jaxdp on 2 processes x 2 devices (parity_tests/test_distributed_parity.py) against
# torch_ref DDP on 4 ranks; the run: the MLP, 5 steps of 4 x 2 micro-batches.
MULTI_PROCESS = ParityConfig(
    model="mlp", optimizer="adamw", num_devices=4, accum_steps=2, steps=5, dtype="float64"
)


# BatchNorm: DDP's per-rank statistics (broadcast_buffers=True) against
# batch_stats="local", SyncBatchNorm against "sync"; weights and running statistics.
BATCH_NORM = [
    ParityConfig(
        model="cnn_bn",
        optimizer=optimizer,
        num_devices=2,
        accum_steps=k,
        steps=STEPS,
        path=path,
        strategy=strategy,
        sync_batchnorm=sync,
    )
    for sync in (False, True)
    for k, path, strategy, optimizer in (
        (1, "fused", "shard_map" if sync else "pmap", "sgd_momentum"),
        (2, "fused", "pmap" if sync else "shard_map", "adamw"),
        (2, "multisteps", "shard_map", "sgd_nesterov_wd"),
    )
]

# A frozen embedding and a branch unused by every rank in some steps (data in
# order: steps 3, 6, 9 leave it unused everywhere, steps 2, 5, 8 use it on one
# rank's micro-batch only). SGD only: torch's AdamW keeps a step count per
# parameter, which a skipped parameter does not advance (docs/decisions.md).
UNUSED = [
    ParityConfig(
        model="embed_branch",
        optimizer=optimizer,
        num_devices=n,
        accum_steps=k,
        steps=STEPS,
        path=path,
        strategy=strategy,
        num_samples=160,
        shuffle=False,
    )
    for n, k, path, strategy, optimizer in (
        (2, 2, "fused", "shard_map", "sgd_nesterov_wd"),
        (2, 2, "multisteps", "pmap", "sgd_momentum"),
        (1, 4, "fused", "shard_map", "sgd_momentum"),
    )
]

ALL = [*FLOAT64, *FLOAT32, *LAST_WINDOW, MULTI_PROCESS, *BATCH_NORM, *UNUSED]

# Issue 14, outside ALL (their torch runs take options ParityConfig has no field for;
# TORCH_OPTIONED lists them for conftest's torch_runs). jaxdp's zero_stage against
# torch_ref's ZeroRedundancyOptimizer (zero=True): every optimizer, the layouts,
# both paths, both stages; shard_map, the strategy jaxdp's stages run on.
ZERO = [
    (
        ParityConfig(
            model="mlp", optimizer=optimizer, num_devices=n, accum_steps=k, steps=STEPS, path=path
        ),
        stage,
    )
    for optimizer, (n, k), path, stage in (
        ("sgd_momentum", (2, 1), "fused", 1),
        ("sgd_nesterov_wd", (2, 3), "multisteps", 2),
        ("adamw", (4, 2), "fused", 2),
        ("adamw_clip", (2, 3), "fused", 1),
        ("adamw", (4, 2), "multisteps", 1),
    )
]

# jaxdp's comm_dtype="bfloat16" against torch_ref's comm_hook="bf16", in float32 on 2
# devices: W and K powers of two, so dividing before or after the cast rounds alike.
BF16 = [
    ParityConfig(
        model="mlp", optimizer=optimizer, num_devices=2, accum_steps=2, steps=STEPS,
        dtype="float32", path=path,
    )
    for optimizer, path in (("sgd_momentum", "fused"), ("adamw", "multisteps"))
]  # fmt: skip


def cell_id(config: ParityConfig) -> str:
    n, k = config.num_devices, config.accum_steps
    extra = f"-{config.last_window}" if config.last_window != "drop" else ""
    extra += "-syncbn" if config.sync_batchnorm else ""
    return (
        f"{config.model}-{config.optimizer}-n{n}k{k}-{config.path}-{config.strategy}"
        f"-{config.dtype}{extra}"
    )


def torch_key(config: ParityConfig, option: str) -> str:
    """The torch_runs key of ``config``'s run with a torch_ref option ("zero", "bf16"):
    one run per key, as jaxdp's path does not change torch_ref's run."""
    return cell_id(dataclasses.replace(config, path="fused")) + "-" + option


# (key, config, torch_ref.TrainConfig overrides) of the torch runs with options, one per
# key (a ZERO cell's two stages share their torch run).
TORCH_OPTIONED = list(
    {
        torch_key(config, option): (torch_key(config, option), config, overrides)
        for option, configs, overrides in (
            ("zero", [c for c, _ in ZERO], {"zero": True}),
            ("bf16", BF16, {"comm_hook": "bf16"}),
        )
        for config in configs
    }.values()
)

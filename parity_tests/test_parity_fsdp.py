"""Issue 32, item 7 (the JAX side): jaxdp on ``stack`` (its 3 blocks ONE ``nnx.vmap``
module, run by ``jaxdp.scan_layers``) against torch_ref's FSDP2 and HSDP runs, after every
optimizer step: ZeRO stage 3 on the whole grid ({FSDP 1 x 2, FSDP 1 x 4, HSDP 2 x 2} x K in
{1, 3} x {fused, multisteps}, 12 cells) and stage 0 on one cell; and torch's
``nn.ModuleList`` <-> the stacked leaves (``torch_to_params`` / ``params_to_torch``).

The torch runs are test_torch_ref_fsdp.py's (its ``torch_jobs``, imported, so the test
run's shared batch makes them once for both files): FSDP2 on 2 and 4 gloo ranks and HSDP
on a 2 x 2 mesh, each at K = 1 and 3, and their DDP twins, float64, AdamW with decay and a
clip that acts, 3 steps.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from test_torch_ref_fsdp import (
    MICRO_BATCH_SIZE,
    MODEL,
    NUM_SAMPLES,
    OPTIMIZER,
    SHARDED,
    STEPS,
)
from test_torch_ref_fsdp import torch_jobs as torch_jobs  # the batch's runs, shared

import torch_ref as tr
from jaxdp.models import build_model
from jaxdp.parity import (
    OptimizerSpec,
    ParityConfig,
    Trajectory,
    compare,
    format_parity,
    params_to_torch,
    run_jaxdp,
    torch_config,
    torch_to_params,
)

# The bound. Both sides compute in float64; they differ in how sums are grouped
# (FSDP2's reduce-scatter per block and the clip's norm from shards, DDP's buckets, XLA's
# reductions and jaxdp's gathers per layer) and in AdamW's reassociated formulas: a few
# float64 roundings per step, compounding over 3 steps. Observed over the 13 cells: at most
# 2.7e-14 of a tensor's largest element (FSDP N = 2, K = 1: both stages and paths; the other
# layouts and K 9.5e-16 to 2.5e-15), 3e-16 relative on the losses.
PARITY_RTOL = 1e-10

# The grid, every cell at stage 3 against torch's run of its layout and K (one torch run
# serves both paths): FSDP 1 x N for N in {2, 4} and HSDP 2 x 2 (below), each at K in {1, 3}
# on the fused and the multisteps path. Stage 0 on one cell, against FSDP2 and DDP: the port
# and the ModuleList conversion, apart from stage 3.
PATHS = ["fused", "multisteps"]
FSDP = [(n, k, path) for n in (2, 4) for k in (1, 3) for path in PATHS]
HSDP = [(4, k, path) for k in (1, 3) for path in PATHS]
# Each stage-3 cell under one of the layer loop's remat choices, in turn over FSDP then
# HSDP: each choice meets both layouts, N 2 and 4, K 1 and 3 and both paths
# (test_every_remat_choice_meets_every_kind_of_cell). The remat changes what the backward
# recomputes, never a value: every cell holds the same tolerance.
REMATS = ["dots", "full", "dots_with_no_batch_dims_saveable"]
REMAT = {
    cell: REMATS[i % 3]
    for i, cell in enumerate([("fsdp", *c) for c in FSDP] + [("hsdp", *c) for c in HSDP])
}
CELLS = [(2, 1, "fused", 0)] + [(*cell, 3) for cell in FSDP]


def parity_config(
    num_devices: int,
    accum_steps: int,
    path: str,
    stage: int = 3,
    shards: int | None = None,
    remat: str = "dots",
) -> ParityConfig:
    """The cell as `jaxdp parity --model stack --zero-stage STAGE [--shards S] [--remat R]`
    runs it: ParityConfig's zero_stage and shards choose both jaxdp's Parallel and torch's
    run, its remat jaxdp's layer loop."""
    return ParityConfig(
        model=MODEL,
        zero_stage=stage,
        shards=shards,
        remat=remat,
        optimizer=OptimizerSpec(**dataclasses.asdict(OPTIMIZER)),
        num_devices=num_devices,
        accum_steps=accum_steps,
        micro_batch_size=MICRO_BATCH_SIZE,
        steps=STEPS,
        path=path,
        num_samples=NUM_SAMPLES,
    )


@pytest.fixture(scope="module")
def runs(torch_batch):
    """test_torch_ref_fsdp.py's torch runs, ``{(strategy, N, K): torch_ref.Result}``."""
    return torch_batch[torch_jobs.__module__]


@pytest.mark.parametrize(
    ("num_devices", "accum_steps", "path", "stage"),
    CELLS,
    ids=[f"fsdp-n{n}-k{k}-{path}-stage{stage}" for n, k, path, stage in CELLS],
)
def test_stack_trains_as_torch_fsdp2(runs, num_devices, accum_steps, path, stage):
    remat = REMAT[("fsdp", num_devices, accum_steps, path)] if stage == 3 else "dots"
    config = parity_config(num_devices, accum_steps, path, stage, remat=remat)
    fsdp = ("fsdp", num_devices, accum_steps)
    torch_run, data, initial = torch_jobs()[fsdp]
    # The torch run trains what this config describes (model, data, order, optimizer; at
    # stage 3 FSDP2 by the config itself), and jaxdp the stage it names.
    assert torch_config(config, **({} if stage == 3 else {"fsdp": True})) == torch_run
    ours = jaxdp_run(config, data, initial)
    # Stage 0 is DDP's arithmetic: against torch's DDP twin too.
    for key in [fsdp, ("ddp", num_devices, accum_steps)][: 2 if stage == 0 else 1]:
        assert_trains_as(config, ours, runs[key], key)


@pytest.mark.parametrize(
    ("num_devices", "accum_steps", "path"),
    HSDP,
    ids=[f"hsdp-n{n}-k{k}-{path}-stage3" for n, k, path in HSDP],
)
def test_stack_trains_as_torch_hsdp(runs, num_devices, accum_steps, path):
    # 2 replicas x 2 shards: torch's (replicate, shard) device mesh, jaxdp's
    # Parallel(zero_stage=3, shards=2).
    remat = REMAT[("hsdp", num_devices, accum_steps, path)]
    config = parity_config(num_devices, accum_steps, path, shards=2, remat=remat)
    hsdp = ("hsdp", num_devices, accum_steps)
    torch_run, data, initial = torch_jobs()[hsdp]
    assert torch_config(config) == torch_run
    assert_trains_as(config, jaxdp_run(config, data, initial), runs[hsdp], hsdp)


def jaxdp_run(config: ParityConfig, data, initial) -> Trajectory:
    """jaxdp's trajectory for the cell; at stage 3 the blocks must reach scan_layers split,
    to be gathered a layer at a time (no warning that they are not)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"Parallel\(zero_stage=3\)")
        return run_jaxdp(config, data, initial)


def assert_trains_as(config: ParityConfig, ours: Trajectory, run: tr.Result, key) -> None:
    """jaxdp's trajectory within PARITY_RTOL of torch's ``run`` at every step."""
    report = compare(config, ours, Trajectory(run.states, list(run.losses)), rtol=PARITY_RTOL)
    assert report.passed, f"{key}\n" + format_parity(report)


def test_the_grid_is_every_torch_run_on_both_paths():
    # Stage 3 meets every sharded torch run (layout, N, K) on the fused and the multisteps
    # path, and the torch file makes no run that no cell reads.
    grid = [("fsdp", n, k, path) for n, k, path, stage in CELLS if stage == 3]
    grid += [("hsdp", n, k, path) for n, k, path in HSDP]
    assert sorted(grid) == sorted((*key, path) for key in SHARDED for path in PATHS)
    assert len(set(grid)) == 12


def test_every_remat_choice_meets_every_kind_of_cell():
    for remat in REMATS:
        cells = [cell for cell, r in REMAT.items() if r == remat]
        for position, values in enumerate([("fsdp", "hsdp"), (2, 4), (1, 3), tuple(PATHS)]):
            assert {cell[position] for cell in cells} == set(values), (remat, cells)


# ---- nn.ModuleList <-> stacked leaves --------------------------------------------------


def test_module_list_converts_to_the_stack_and_back_exactly():
    torch_model = tr.build_model(MODEL)
    state_dict = torch_model.state_dict()
    like = build_model(MODEL, param_dtype=jnp.float64)
    model = torch_to_params(torch_model, like)
    # Layer i of the stacked leaf is blocks.i's tensor, in nn.Linear's transpose.
    kernel = np.asarray(model.blocks.fc.kernel[...])
    assert kernel.shape == (3, 12, 24)
    for i in range(3):
        np.testing.assert_array_equal(kernel[i], state_dict[f"blocks.{i}.fc.weight"].numpy().T)
    # The same function: both forwards agree to float64 rounding.
    x = tr.make_data(MODEL, 8)[0]
    np.testing.assert_allclose(
        np.asarray(model(jnp.asarray(x))),
        torch_model(torch.from_numpy(x)).detach().numpy(),
        rtol=1e-13,  # the same float64 products summed in other orders; observed 5e-16
        atol=1e-13,
    )
    # Back under torch's keys, bitwise, from the module or its state_dict.
    for like_torch in (torch_model, tr.numpy_state_dict(torch_model)):
        back = params_to_torch(model, like_torch)
        assert list(back) == list(state_dict)
        for key, tensor in state_dict.items():
            np.testing.assert_array_equal(back[key], tensor.numpy(), err_msg=key)
    torch_model.load_state_dict({k: torch.from_numpy(v) for k, v in back.items()})


def test_a_wrong_number_of_torch_layers_is_refused_naming_the_key():
    like = build_model(MODEL, param_dtype=jnp.float64)
    state_dict = tr.numpy_state_dict(tr.build_model(MODEL))
    two = {k: v for k, v in state_dict.items() if not k.startswith("blocks.2.")}
    with pytest.raises(ValueError, match=r"has no 'blocks\.2\.fc\.bias'.* holds 3 layers"):
        torch_to_params(two, like)
    four = state_dict | {k.replace(".0.", ".3."): v for k, v in state_dict.items() if ".0." in k}
    with pytest.raises(ValueError, match=r"'blocks\.3\.fc\.bias' has no layer to fill"):
        torch_to_params(four, like)
    with pytest.raises(ValueError, match=r"has no 'blocks\.2\.fc\.bias'"):
        params_to_torch(like, two)
    # A layer of the wrong shape is named with its index.
    wrong = state_dict | {"blocks.1.fc.bias": np.zeros(23)}
    with pytest.raises(ValueError, match=r"'blocks\.1\.fc\.bias'.* layer 1 of the stacked"):
        torch_to_params(wrong, like)


def test_a_stacked_pytree_reads_the_module_list_too():
    # Linen's nn.scan parameters, or a dict stacked by hand: the same numbered keys.
    torch_model = tr.build_model(MODEL)
    state_dict = torch_model.state_dict()
    like = jax.tree.map(
        np.asarray,
        nnx.to_pure_dict(nnx.state(build_model(MODEL, param_dtype=jnp.float64), nnx.Param)),
    )
    params = torch_to_params(torch_model, like)
    assert params["blocks"]["proj"]["kernel"].shape == (3, 24, 12)
    np.testing.assert_array_equal(
        params["blocks"]["proj"]["kernel"][2], state_dict["blocks.2.proj.weight"].numpy().T
    )
    back = params_to_torch(params, torch_model)
    for key, tensor in state_dict.items():
        np.testing.assert_array_equal(back[key], tensor.numpy(), err_msg=key)

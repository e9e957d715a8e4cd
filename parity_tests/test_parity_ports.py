"""compare_models on a user's own models (port_models.py): two NNX ports train like their
torch models in float64, five broken ports are caught with the stage and parameter the
divergence locator names, and a mapping error lists every problem on both sides."""

import functools
import re

import optax
import port_models as pm
import pytest
from flax import nnx

import torch_ref
from jaxdp.parity import (
    Divergence,
    OptimizerSpec,
    assert_trains_like,
    compare,
    compare_models,
    format_parity,
)
from jaxdp.parity._port import prepare, run_jax_port, torch_trajectory

SGD = OptimizerSpec("sgd", 0.1, momentum=0.9)
# The encoder trains with SGD: its attention's key bias has a true gradient of zero
# (softmax cancels it), and Adam would turn the rounding noise into full steps.
PAIRS = {
    "rescnn": (pm.TorchResCNN, pm.JaxResCNN, pm.images, "adamw"),
    "encoder": (pm.TorchEncoder, pm.JaxEncoder, pm.tokens, SGD),
}
LAYOUTS = ((1, 4), (2, 2))  # (num_devices, accum_steps)
STEPS = 10


def make_port(name, num_devices, accum_steps, **options):
    torch_model, jax_model, data, optimizer = PAIRS[name]
    layout = dict(micro_batch_size=2, steps=STEPS, dtype="float64", path="fused")
    layout |= dict(strategy="shard_map", shuffle=True, seed=0, last_window="drop")
    return prepare(
        torch_model,
        options.pop("jax_model", jax_model),
        data(),
        loss=options.pop("loss", "cross_entropy"),
        optimizer=optimizer,
        jax_optimizer=None,
        mapping=None,
        step_options=None,
        num_devices=num_devices,
        accum_steps=accum_steps,
        torch_device="cpu",
        **layout,
    )


@functools.cache
def ports() -> dict[tuple, object]:
    """``{(name, n, k): port}``: each port on each layout, prepared once."""
    return {(name, n, k): make_port(name, n, k) for name in PAIRS for n, k in LAYOUTS}


def torch_jobs() -> dict[tuple, tuple]:
    """The DDP runs of the ports, for the run's shared batch (conftest.py's torch_batch:
    one start of 2 ranks for this file and the others)."""
    return {key: p.torch_job() for key, p in ports().items() if key[1] > 1}


@pytest.fixture(scope="module")
def port_runs(torch_batch):
    """``{(name, n, k): (port, torch_ref.Result)}``; the one-device runs in this process."""
    ddp = torch_batch[__name__]
    return {
        key: (p, ddp[key] if key[1] > 1 else torch_ref.train_ga(*p.torch_job()))
        for key, p in ports().items()
    }


# Each port on both layouts (one device's accumulation, DDP on 2 ranks) and both paths,
# the path alternating with the layout: a cell that differed from these only in N x K
# went (issue 31: 8 cells before); N x K is tests/core/test_equivalence.py's grid.
PORT_CELLS = [
    (name, layout, ("fused", "multisteps")[(m + li) % 2])
    for m, name in enumerate(PAIRS)
    for li, layout in enumerate(LAYOUTS)
]


@pytest.mark.parametrize(
    ("name", "layout", "path"),
    PORT_CELLS,
    ids=[f"{c[0]}-n{c[1][0]}k{c[1][1]}-{c[2]}" for c in PORT_CELLS],
)
def test_port_trains_like_its_torch_model(port_runs, name, layout, path):
    port, result = port_runs[(name, *layout)]
    report = compare(port.config, run_jax_port(port, path), torch_trajectory(port, result))
    assert report.passed and len(report.max_abs) == STEPS, format_parity(report)
    assert report.rtol == 1e-10


# ---- broken ports: (what, compare_models options, stage, module, a parameter named) ------------

K = 2  # accum_steps of the broken runs: one device, two micro-batches, one step
CLIP = OptimizerSpec("sgd", 0.1, momentum=0.9, max_grad_norm=0.01)
BROKEN = {
    "layer_norm_epsilon": (
        dict(jax_model=pm.encoder_flax_epsilon),
        "forward",
        "ln2",
        "ln2.scale",
    ),
    "gelu_approximation": (dict(jax_model=pm.encoder_tanh_gelu), "forward", "mlp", "mlp.fc.kernel"),
    "transposed_kernel": (dict(mapping=pm.UNTRANSPOSED), "forward", "mlp.fc", "mlp.fc.kernel"),
    "missing_loss_div_accum_steps": (
        dict(loss=("cross_entropy", pm.jax_summed_window_loss(K))),
        "loss",
        None,
        None,
    ),
    "optax_clip": (
        dict(
            optimizer=CLIP,
            jax_optimizer=optax.chain(
                optax.clip_by_global_norm(CLIP.max_grad_norm), optax.sgd(0.1, momentum=0.9)
            ),
        ),
        # The momentum buffer holds the clipped gradient: the first quantity that differs.
        "optimizer moments",
        None,
        "head.kernel",
    ),
}


@pytest.mark.parametrize("broken", BROKEN)
def test_locator_names_the_stage_and_parameter_of_a_broken_port(broken):
    options, stage, module, parameter = BROKEN[broken]
    options = {"optimizer": SGD, **options}
    report = compare_models(
        pm.TorchEncoder,
        options.pop("jax_model", pm.JaxEncoder),
        pm.tokens(16),
        num_devices=1,
        accum_steps=K,
        micro_batch_size=2,
        steps=1,
        **options,
    )
    found = report.divergence
    assert report.first_failure == 1 and isinstance(found, Divergence), format_parity(report)
    assert (found.step, found.stage, found.module) == (1, stage, module), found.describe()
    if parameter is not None:
        assert parameter in found.names, found.describe()
    if broken == "missing_loss_div_accum_steps":
        assert f"= accum_steps ({K})" in found.describe()


def test_assert_trains_like_raises_with_the_locators_finding():
    with pytest.raises(AssertionError, match=r"(?s)forward, in ln2: .*FAIL: step 1"):
        assert_trains_like(
            pm.TorchEncoder,
            pm.encoder_flax_epsilon,
            pm.tokens(16),
            optimizer=SGD,
            steps=1,
            accum_steps=K,
            micro_batch_size=2,
        )


class RenamedPort(nnx.Module):
    """The ResCNN port with its stem renamed and a head of 5 classes."""

    def __init__(self, *, rngs):
        self.conv_in = nnx.Conv(1, 8, kernel_size=(3, 3), padding=((1, 1), (1, 1)), rngs=rngs)
        self.block = pm.JaxResBlock(8, rngs=rngs)
        self.head = nnx.Linear(8, 5, rngs=rngs)


def test_mapping_error_lists_every_problem_on_both_sides_before_training():
    expected = [
        "(6 problems)",
        "torch tensors no JAX leaf takes (2):",
        "  - stem.weight (8, 1, 3, 3): no JAX leaf stem.kernel, stem.weight",
        "  - stem.bias (8,): no JAX leaf stem.bias",
        "JAX leaves no torch tensor fills (2):",
        "  - conv_in.bias (8,): no torch tensor fills it",
        "  - conv_in.kernel (3, 3, 1, 8): no torch tensor fills it",
        "shapes that do not match (2):",
        "  - head.weight (4, 8) -> head.kernel: Linear [out, in] -> [in, out] gives (8, 4), "
        "the JAX leaf is (8, 5)",
        "  - head.bias (4,) -> head.bias: as is gives (4,), the JAX leaf is (5,)",
    ]
    with pytest.raises(ValueError) as error:
        compare_models(pm.TorchResCNN, RenamedPort, pm.images(8), steps=1)
    for line in expected:
        assert line in str(error.value), str(error.value)
    # A mapping for the renamed layer leaves only the head's shapes.
    renamed = {"stem.weight": "conv_in.kernel", "stem.bias": "conv_in.bias"}
    with pytest.raises(ValueError, match=re.escape("(2 problems)")):
        compare_models(pm.TorchResCNN, RenamedPort, pm.images(8), mapping=renamed)

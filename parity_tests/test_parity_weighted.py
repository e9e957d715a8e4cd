"""Parity for a real script (issue 43, item 5): a token-weighted loss over padded rows and
a learning-rate schedule, torch's DDP script against its JAX port, at float64 tolerance;
and (issue 51, item 1) four bugs planted in the port one at a time, each located with its
kind by the divergence locator, on the same torch run."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
import token_lm
import torch

from jaxdp.parity import OptimizerSpec, compare_models, format_parity, onecycle_like_torch
from jaxdp.parity._compare_models import report_of
from jaxdp.parity._locate import STAGES
from jaxdp.parity._port import prepare

ADAMW = OptimizerSpec("adamw", token_lm.BASE_LR, weight_decay=1e-2)
BUG_STEPS = 2  # each planted bug fails at step 1; its port trains the torch run's first steps


def script_port(steps=token_lm.STEPS, **planted):
    """The script's port on 2 devices x 2 micro-batches of 3 rows; ``planted`` replaces
    compare_models' options of the JAX side."""
    options = dict(
        loss=(token_lm.torch_token_loss, token_lm.jax_token_loss),
        schedule=(token_lm.torch_schedule, token_lm.optax_schedule),
        jax_optimizer=None,
        step_options=None,
    )
    return prepare(
        token_lm.TorchLM,
        token_lm.JaxLM,
        token_lm.data(),
        optimizer=ADAMW,
        mapping=None,
        **{**options, **planted},
        loss_reduction="weighted",
        num_devices=2,
        accum_steps=2,
        micro_batch_size=3,
        steps=steps,
        dtype="float64",
        path="fused",
        strategy="shard_map",
        shuffle=True,
        seed=0,
        last_window="drop",
        torch_device="cpu",
    )


def torch_jobs():
    """The script's one DDP run, shared by the tests below (conftest.py's torch_batch)."""
    return {"script": script_port().torch_job()}


def schedule_one_step_ahead(count):
    return token_lm.optax_schedule(count + 1)


def jax_mean_token_loss(out, y):
    """Each micro-batch's own mean over its real tokens (jaxdp's loss_reduction="mean")."""
    loss_sum, count = token_lm.jax_token_loss(out, y)
    return loss_sum / count


def not_bias(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "bias" not in jax.tree_util.keystr(path), params
    )


def adamw(**options):
    """The port's own AdamW on the script's schedule (torch's eps and decay, unless told)."""
    options = {"eps": 1e-8, "eps_root": 0.0, "weight_decay": 1e-2, **options}
    return optax.adamw(token_lm.optax_schedule, **options)


OWN_OPTIMIZER = dict(schedule=(token_lm.torch_schedule, None))
# planted bug: (the port's options, the first quantity that differs, its kind, names there)
PLANTED = {
    "schedule_one_step_ahead": (
        dict(schedule=(token_lm.torch_schedule, schedule_one_step_ahead)),
        "learning rate",
        "schedule",
        ["lr"],
    ),
    # The same in the port's own optimizer: its rate read from inject_hyperparams' state.
    "schedule_one_step_ahead_in_its_own_optimizer": (
        dict(
            jax_optimizer=optax.inject_hyperparams(optax.adamw)(
                learning_rate=schedule_one_step_ahead, eps=1e-8, eps_root=0.0, weight_decay=1e-2
            ),
            **OWN_OPTIMIZER,
        ),
        "learning rate",
        "schedule",
        ["lr"],
    ),
    "loss_averaged_per_micro_batch": (
        dict(
            loss=(token_lm.torch_token_loss, jax_mean_token_loss),
            step_options={"loss_reduction": "mean"},
        ),
        "loss",
        "loss",
        ["loss of micro-batch"],
    ),
    "adam_eps_inside_the_square_root": (
        dict(jax_optimizer=adamw(eps=0.0, eps_root=1e-8), **OWN_OPTIMIZER),
        "optimizer update",
        "optimizer formula",
        ["embed.embedding", "head.bias", "head.kernel"],
    ),
    "no_weight_decay_on_biases": (
        dict(jax_optimizer=adamw(mask=not_bias), **OWN_OPTIMIZER),
        "optimizer update",
        "weight decay or mask",
        ["head.bias"],
    ),
}
# What each finding reads, beyond its kind.
READING = {
    "schedule_one_step_ahead": "an optax schedule of f(count + 1) is a step ahead",
    "schedule_one_step_ahead_in_its_own_optimizer": "f(count + 1) is a step ahead",
    "loss_averaged_per_micro_batch": "the port averages per micro-batch",
    "adam_eps_inside_the_square_root": "torch adds eps outside the square root",
    "no_weight_decay_on_biases": "the port does not decay them; torch does",
}


def test_a_token_weighted_scheduled_ddp_script_trains_like_its_port(torch_batch):
    report = report_of(
        script_port(), torch_batch[__name__]["script"], rtol=None, atol=None, locate=True
    )
    assert report.passed, format_parity(report)
    assert report.rtol == 1e-10  # float64's "torch_trajectory" row
    # The locator compares every quantity of the step and finds none differing.
    found = report.divergence
    assert [s.stage for s in found.stages] == list(STAGES), found.describe()
    assert (found.stage, found.kind) == (None, None), found.describe()


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_is_located_with_its_kind(torch_batch, bug):
    planted, stage, kind, names = PLANTED[bug]
    run = torch_batch[__name__]["script"]
    first = dataclasses.replace(run, states=run.states[:BUG_STEPS], losses=run.losses[:BUG_STEPS])
    report = report_of(script_port(BUG_STEPS, **planted), first, rtol=None, atol=None, locate=None)
    found, text = report.divergence, format_parity(report)
    assert report.first_failure == 1 and found is not None, text
    assert (found.step, found.stage, found.kind) == (1, stage, kind), text
    assert all(any(n.startswith(name) for n in found.names) for name in names), text
    if stage == "optimizer update":
        assert sorted(found.names) == names, text
    assert f"kind: {kind}" in text and READING[bug] in text, text


def test_one_cycle_lr_trains_like_its_optax_twin():
    def torch_one_cycle(optimizer):
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=0.02, total_steps=8, cycle_momentum=False
        )

    report = compare_models(
        token_lm.TorchLM,
        token_lm.JaxLM,
        token_lm.data(),
        loss=(token_lm.torch_token_loss, token_lm.jax_token_loss),
        loss_reduction="weighted",
        schedule=(torch_one_cycle, onecycle_like_torch(0.02, 8)),
        optimizer=ADAMW,
        num_devices=1,
        steps=8,
    )
    assert report.passed, format_parity(report)


def test_a_loss_of_the_other_reduction_is_refused_before_torch_trains(monkeypatch):
    monkeypatch.setattr(
        "jaxdp.parity._compare_models.run_torch_port", lambda port: pytest.fail("torch trained")
    )
    pair = (token_lm.torch_token_loss, token_lm.jax_token_loss)
    with pytest.raises(ValueError, match=r"returns a tuple of 2 values, and loss_reduction='mean"):
        compare_models(token_lm.TorchLM, token_lm.JaxLM, token_lm.data(), loss=pair)
    with pytest.raises(ValueError, match=r"returns an array of shape \(\), and loss_reduction='w"):
        compare_models(
            token_lm.TorchLM,
            token_lm.JaxLM,
            token_lm.data(),
            loss=(token_lm.torch_token_loss, lambda out, y: token_lm.jax_token_loss(out, y)[0]),
            loss_reduction="weighted",
        )


def test_an_optax_schedule_rounded_to_float32_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"returns float32 .*jnp.asarray\(count, jnp.int64\)"):
        compare_models(
            token_lm.TorchLM,
            token_lm.JaxLM,
            token_lm.data(),
            loss=(token_lm.torch_token_loss, token_lm.jax_token_loss),
            loss_reduction="weighted",
            schedule=(token_lm.torch_schedule, optax.linear_schedule(0.01, 0.0, 10)),
            num_devices=1,
        )
    assert jnp.asarray(token_lm.optax_schedule(jnp.zeros((), jnp.int32))).dtype == jnp.float64

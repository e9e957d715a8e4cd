"""Parity for a real script (issue 43, item 5): a token-weighted loss over padded rows and
a learning-rate schedule, torch's DDP script against its JAX port, at float64 tolerance."""

import jax.numpy as jnp
import optax
import pytest
import token_lm
import torch

from jaxdp.parity import OptimizerSpec, compare_models, format_parity, onecycle_like_torch

ADAMW = OptimizerSpec("adamw", token_lm.BASE_LR, weight_decay=1e-2)


def test_a_token_weighted_scheduled_ddp_script_trains_like_its_port():
    report = compare_models(
        token_lm.TorchLM,
        token_lm.JaxLM,
        token_lm.data(),
        loss=(token_lm.torch_token_loss, token_lm.jax_token_loss),
        loss_reduction="weighted",
        schedule=(token_lm.torch_schedule, token_lm.optax_schedule),
        optimizer=ADAMW,
        num_devices=2,
        accum_steps=2,
        micro_batch_size=3,
        steps=token_lm.STEPS,
    )
    assert report.passed, format_parity(report)
    assert report.rtol == 1e-10  # float64's "torch_trajectory" row


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
    with pytest.raises(ValueError, match="locate=True replays mean losses only"):
        compare_models(
            token_lm.TorchLM,
            token_lm.JaxLM,
            token_lm.data(),
            loss_reduction="weighted",
            locate=True,
        )
    assert jnp.asarray(token_lm.optax_schedule(jnp.zeros((), jnp.int32))).dtype == jnp.float64

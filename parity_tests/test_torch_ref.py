"""torch_ref on its own: the seed's published result, DistributedSampler's order, DDP on
real gloo processes == gradient accumulation in one process, the last-window policy,
the models' layout, and errors. Imports neither jax nor jaxdp."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

import torch_ref as tr

# The seed example's published weights ("Multiple GPU training in PyTorch and Gradient
# Accumulation", docs/parity.md), rounded to 4 decimals: hence 5e-5.
SEED_FINAL = np.array([[0.9472, 0.9440, 0.9527, 0.9687, 0.9570, 0.9343, 0.9411, 0.9186]])
SEED_ATOL = 5e-5
# DDP (W ranks x K micro-batches) vs one process with W*K micro-batches in float64: the
# same micro-batches, summed in another order (per rank with 1/K, then 1/W and across
# ranks; vs all W*K with 1/(W K)). Observed after 6 steps: at most 1.7e-13 relative (on
# elements near zero) and 1.1e-16 absolute. The absolute floor serves elements near
# zero, where a relative error means nothing; it is ~100 ulps of 1.0.
FLOAT64_RTOL = 1e-12
FLOAT64_ATOL = 1e-14
# A closed form against torch's float64 sums of a few rows: a few ulps.
CLOSED_FORM_RTOL = 1e-14

SGD_MOMENTUM = tr.OptimConfig("sgd", 0.01, momentum=0.9)
# One optimizer per model, so that each model and each optimizer runs under DDP.
OPTIMIZERS = {
    "linear": tr.OptimConfig("sgd", 0.01, momentum=0.9),
    "mlp": tr.OptimConfig("sgd", 0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "cnn": tr.OptimConfig("adamw", 1e-2, weight_decay=1e-2),
    "transformer": tr.OptimConfig("adamw", 1e-2, weight_decay=1e-2, max_grad_norm=0.5),
}
# The models whose DDP run equals one process accumulating the same micro-batches. Not
# cnn_bn (DDP normalizes per rank, its running statistics are rank 0's: see
# syncbn_config) nor embed_branch (it needs find_unused_parameters); jaxdp's parity with
# both is in test_parity_model_state.py.
DDP_EQUALS_GA = tuple(OPTIMIZERS)


def initial_state(model: str, seed: int = 0) -> dict[str, np.ndarray]:
    return tr.numpy_state_dict(tr.build_model(model, seed=seed))


def seed_ga_config() -> tr.TrainConfig:
    """The seed's gradient accumulation: 1 device, 2 micro-batches of 4 per step."""
    return tr.TrainConfig(
        "linear", SGD_MOMENTUM, micro_batch_size=4, accum_steps=2, epochs=2, shuffle=False
    )


def seed_ddp_config() -> tr.TrainConfig:
    """The seed's DDP: 2 ranks, one micro-batch of 4 per step (rank r: rows r, r+2, ...)."""
    return tr.TrainConfig(
        "linear", SGD_MOMENTUM, micro_batch_size=4, num_devices=2, epochs=2, shuffle=False
    )


def ddp_vs_ga_config(model: str) -> tr.TrainConfig:
    """36 rows over 2 ranks: 18 each, 4 micro-batches of 4 (2 rows dropped), 2 steps of
    K=2 per epoch, reshuffled each epoch."""
    return tr.TrainConfig(
        model,
        OPTIMIZERS[model],
        micro_batch_size=4,
        num_devices=2,
        accum_steps=2,
        epochs=3,
        seed=3,
    )


def last_window_config() -> tr.TrainConfig:
    """40 rows over 2 ranks: 5 micro-batches of 4 each, so windows of 2, 2 and 1."""
    return tr.TrainConfig(
        "mlp",
        OPTIMIZERS["mlp"],
        micro_batch_size=4,
        num_devices=2,
        accum_steps=2,
        epochs=2,
        shuffle=False,
        last_window="step",
    )


def syncbn_config() -> tr.TrainConfig:
    """cnn_bn with SyncBatchNorm: 32 rows in order over 2 ranks, 2 steps of K=2 x 4 rows."""
    return tr.TrainConfig(
        "cnn_bn",
        tr.OptimConfig("sgd", 0.05, momentum=0.9),
        micro_batch_size=4,
        num_devices=2,
        accum_steps=2,
        shuffle=False,
        sync_batchnorm=True,
    )


def ga_equivalent(config: tr.TrainConfig, num_samples: int) -> tuple[np.ndarray, tr.TrainConfig]:
    """Rows and config for ONE process that feeds each step the micro-batches the DDP
    ranks feed: rank r takes ``order[r::W]`` (``num_samples % W == 0``: no padding), so
    step t gets rank 0's K micro-batches, then rank 1's, ..., as one window of W*K.

    Shuffled runs become one epoch over the concatenated epoch orders (the dropped
    windows left out); unshuffled ones keep the epochs, whose incomplete window of
    W*r micro-batches then matches the ranks' r each.
    """
    w, k, b = config.num_devices, config.accum_steps, config.micro_batch_size
    assert num_samples % w == 0
    # One GA epoch over several shuffled epochs would merge a short window with the next.
    assert not (config.shuffle and config.last_window == "step")
    epochs = range(config.epochs) if config.shuffle else [0]
    rows = []
    for epoch in epochs:
        order = tr.torch_permutation(num_samples, config.seed + epoch)
        order = order if config.shuffle else np.arange(num_samples)
        per_rank = [order[r::w][: len(order[r::w]) // b * b].reshape(-1, b) for r in range(w)]
        num_micro = len(per_rank[0])
        ends = list(range(k, num_micro + 1, k))
        if config.last_window == "step" and num_micro % k:
            ends.append(num_micro)
        for start, end in zip([0, *ends[:-1]], ends, strict=True):
            rows += [per_rank[r][start:end].ravel() for r in range(w)]
    ga = dataclasses.replace(
        config,
        num_devices=1,
        accum_steps=w * k,
        shuffle=False,
        epochs=config.epochs if not config.shuffle else 1,
    )
    return np.concatenate(rows), ga


def torch_jobs() -> dict[str, tuple]:
    """Every 2-rank spawn run of this file, for the run's shared batch (conftest.py's
    torch_batch: one start of the processes for this file and the others)."""
    jobs = {"seed": (seed_ddp_config(), tr.seed_data(), initial_state("linear"))}
    for model in DDP_EQUALS_GA:
        jobs[model] = (ddp_vs_ga_config(model), tr.make_data(model, 36), initial_state(model))
    jobs["syncbn"] = (syncbn_config(), tr.make_data("cnn_bn", 32), initial_state("cnn_bn"))
    jobs["last_window"] = (last_window_config(), tr.make_data("mlp", 40), initial_state("mlp"))
    return jobs


@pytest.fixture(scope="module")
def ddp2(torch_batch) -> dict[str, tr.Result]:
    """The results of torch_jobs(), spawned on 2 ranks."""
    return torch_batch[__name__]


def assert_states_close(
    actual: dict, expected: dict, *, rtol: float, atol: float = 0.0, label: str = ""
) -> None:
    """Same keys, every element within ``atol + rtol * |expected|``."""
    assert actual.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(
            actual[key], expected[key], rtol=rtol, atol=atol, err_msg=f"{label} {key}"
        )


def test_seed_result_gradient_accumulation():
    result = tr.train_ga(seed_ga_config(), tr.seed_data(), initial_state("linear"))
    assert len(result.states) == 2  # one step per epoch
    np.testing.assert_allclose(result.final["linear.weight"], SEED_FINAL, rtol=0, atol=SEED_ATOL)
    # The first loss is (sum of all x @ ones) / 2: two micro-batch sums over K=2.
    x, _ = tr.seed_data()
    assert result.losses[0] == pytest.approx(x.sum() / 2, rel=CLOSED_FORM_RTOL)


def test_seed_result_ddp_spawn(ddp2):
    result = ddp2["seed"]
    np.testing.assert_allclose(result.final["linear.weight"], SEED_FINAL, rtol=0, atol=SEED_ATOL)
    ga = tr.train_ga(seed_ga_config(), tr.seed_data(), initial_state("linear"))
    assert_states_close(result.final, ga.final, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    np.testing.assert_allclose(result.losses, ga.losses, rtol=FLOAT64_RTOL)


def test_seed_result_ddp_torchrun_equals_spawn(ddp2):
    jobs = [
        (seed_ddp_config(), tr.seed_data(), initial_state("linear")),
        (
            ddp_vs_ga_config("transformer"),
            tr.make_data("transformer", 36),
            initial_state("transformer"),
        ),
    ]
    seed, transformer = tr.train_ddp_many(jobs, launcher="torchrun")
    np.testing.assert_allclose(seed.final["linear.weight"], SEED_FINAL, rtol=0, atol=SEED_ATOL)
    # Same code, same ranks, same order of operations: bitwise the spawn results.
    for got, want in [(seed, ddp2["seed"]), (transformer, ddp2["transformer"])]:
        assert got.losses == want.losses
        for a, b in zip(got.states, want.states, strict=True):
            assert_states_close(a, b, rtol=0)


@pytest.mark.parametrize("n, seed, epoch", [(7, 0, 0), (10, 5, 2), (64, 3, 1)])
def test_torch_permutation_is_distributed_sampler_order(n, seed, epoch):
    perm = tr.torch_permutation(n, seed + epoch)
    assert sorted(perm) == list(range(n))
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, seed=seed)
    sampler.set_epoch(epoch)
    assert list(sampler) == perm.tolist()
    padded = np.concatenate([perm, perm[: (-n) % 3]])  # 3 ranks: wrap the head around
    for rank in range(3):
        sampler = DistributedSampler(range(n), num_replicas=3, rank=rank, seed=seed)
        sampler.set_epoch(epoch)
        assert list(sampler) == padded[rank::3].tolist()


@pytest.mark.parametrize("model", DDP_EQUALS_GA)
def test_ddp_equals_accumulation_over_the_same_micro_batches(ddp2, model):
    config = ddp_vs_ga_config(model)
    x, y = tr.make_data(model, 36)
    rows, ga_config = ga_equivalent(config, 36)
    ga = tr.train_ga(ga_config, (x[rows], y[rows]), initial_state(model))
    ddp = ddp2[model]
    assert len(ddp.states) == len(ga.states) == 6 == 3 * tr.steps_per_epoch(config, 36)
    for step, (a, b) in enumerate(zip(ddp.states, ga.states, strict=True)):
        assert_states_close(a, b, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL, label=f"step {step}")
    np.testing.assert_allclose(ddp.losses, ga.losses, rtol=FLOAT64_RTOL)
    # It trained: the weights moved.
    assert any(not np.array_equal(ddp.final[k], v) for k, v in initial_state(model).items())


def test_ddp_last_window_step_equals_accumulation(ddp2):
    config = last_window_config()
    x, y = tr.make_data("mlp", 40)
    rows, ga_config = ga_equivalent(config, 40)
    ga = tr.train_ga(ga_config, (x[rows], y[rows]), initial_state("mlp"))
    ddp = ddp2["last_window"]
    assert len(ddp.states) == len(ga.states) == 2 * 3  # windows of 2, 2 and 1 per epoch
    for step, (a, b) in enumerate(zip(ddp.states, ga.states, strict=True)):
        assert_states_close(a, b, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL, label=f"step {step}")
    np.testing.assert_allclose(ddp.losses, ga.losses, rtol=FLOAT64_RTOL)


def test_sync_batchnorm_equals_one_process_with_the_ranks_micro_batches_joined(ddp2):
    """SyncBatchNorm over W ranks x b rows normalizes, and updates its running statistics
    (unbiased over all W*b values), as BatchNorm does on the joined W*b rows."""
    config = syncbn_config()
    x, y = tr.make_data("cnn_bn", 32)
    per_rank = [np.arange(32)[r::2].reshape(-1, 4) for r in range(2)]  # [micro-batch, row]
    rows = np.concatenate([np.concatenate([per_rank[r][j] for r in range(2)]) for j in range(4)])
    ga_config = dataclasses.replace(config, num_devices=1, micro_batch_size=8, sync_batchnorm=False)
    ga = tr.train_ga(ga_config, (x[rows], y[rows]), initial_state("cnn_bn"))
    ddp = ddp2["syncbn"]
    assert len(ddp.states) == len(ga.states) == 2
    for step, (a, b) in enumerate(zip(ddp.states, ga.states, strict=True)):
        assert_states_close(a, b, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL, label=f"step {step}")
    assert int(ddp.final["bn1.num_batches_tracked"]) == 4


def linear_run(last_window: str, *, epochs: int = 1, max_steps: int | None = None) -> tr.Result:
    """10 rows, micro-batches of 2: windows of K=2 micro-batches, 2 and 2 and 1."""
    config = tr.TrainConfig(
        "linear",
        tr.OptimConfig("sgd", 0.1),
        micro_batch_size=2,
        accum_steps=2,
        epochs=epochs,
        max_steps=max_steps,
        shuffle=False,
        last_window=last_window,
    )
    return tr.train_ga(config, tr.make_data("linear", 10), initial_state("linear"))


def test_last_window_policies_closed_form():
    # Plain SGD on loss = sum(x @ w): each micro-batch's gradient is the sum of its rows.
    x, _ = tr.make_data("linear", 10)
    s = x.reshape(5, 2, 8).sum(axis=1)  # per micro-batch
    drop, step = linear_run("drop"), linear_run("step")
    assert len(drop.states) == 2 and len(step.states) == 3
    expect_drop = 1 - 0.1 * ((s[0] + s[1]) / 2 + (s[2] + s[3]) / 2)
    np.testing.assert_allclose(drop.final["linear.weight"][0], expect_drop, rtol=CLOSED_FORM_RTOL)
    # "step" updates once more on the last micro-batch alone, weighted 1/r = 1.
    np.testing.assert_allclose(
        step.final["linear.weight"][0], expect_drop - 0.1 * s[4], rtol=CLOSED_FORM_RTOL
    )
    # Its loss is the last micro-batch's, at the weights after step 2, over r = 1.
    expect_loss = np.sum(x[8:] @ drop.final["linear.weight"][0])
    assert step.losses[2] == pytest.approx(expect_loss, rel=CLOSED_FORM_RTOL)


def test_steps_per_epoch_and_max_steps():
    assert len(linear_run("drop", epochs=3).states) == 6
    assert len(linear_run("step", epochs=3).states) == 9
    full, stopped = linear_run("step", epochs=3), linear_run("step", epochs=3, max_steps=4)
    assert len(stopped.states) == 4
    assert_states_close(stopped.final, full.states[3], rtol=0)
    assert stopped.losses == full.losses[:4]


def test_model_layout():
    shapes = {
        "linear": {"linear.weight": (1, 8)},
        "mlp": {
            "fc1.weight": (32, 16), "fc1.bias": (32,), "fc2.weight": (32, 32),
            "fc2.bias": (32,), "fc3.weight": (4, 32), "fc3.bias": (4,),
        },
        "cnn": {
            "conv1.weight": (8, 1, 3, 3), "conv1.bias": (8,), "conv2.weight": (16, 8, 3, 3),
            "conv2.bias": (16,), "head.weight": (10, 16), "head.bias": (10,),
        },
        "transformer": {
            "tok_emb.weight": (32, 16), "pos_emb.weight": (8, 16),
            "block.ln1.weight": (16,), "block.ln1.bias": (16,),
            **{f"block.attn.{n}.{p}": (16, 16) if p == "weight" else (16,)
               for n in ("query", "value", "proj") for p in ("weight", "bias")},
            "block.attn.key.weight": (16, 16),  # no key bias: softmax cancels it
            "block.ln2.weight": (16,), "block.ln2.bias": (16,),
            "block.mlp.fc.weight": (64, 16), "block.mlp.fc.bias": (64,),
            "block.mlp.proj.weight": (16, 64), "block.mlp.proj.bias": (16,),
            "ln_f.weight": (16,), "ln_f.bias": (16,), "head.weight": (32, 16),
        },
    }  # fmt: skip
    for model, expected in shapes.items():
        assert {k: v.shape for k, v in initial_state(model).items()} == expected
    assert np.all(initial_state("linear")["linear.weight"] == 1)


def test_transformer_is_causal():
    model = tr.build_model("transformer")
    x, _ = tr.make_data("transformer", 2)
    changed = x.copy()
    changed[:, 5] = (changed[:, 5] + 1) % 32
    a, b = model(torch.from_numpy(x)), model(torch.from_numpy(changed))
    assert torch.equal(a[:, :5], b[:, :5])  # positions before 5 never see token 5
    assert not torch.equal(a[:, 5:], b[:, 5:])


def test_every_parameter_has_a_real_gradient():
    # A parameter whose exact gradient is 0 (a key bias under softmax) gets rounding
    # noise, which Adam turns into steps that no two summation orders agree on.
    for name in tr.MODELS:
        model = tr.build_model(name)
        x, y = (torch.from_numpy(a) for a in tr.make_data(name, 16))
        tr.compute_loss(name, model, x, y).backward()
        trained = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
        smallest = min((p.grad.abs().max().item(), k) for k, p in trained)
        assert smallest[0] > 1e-6, (name, smallest)


def test_make_data_is_deterministic():
    for model in tr.MODELS:
        x, y = tr.make_data(model, 12, seed=1, dtype="float32")
        x2, y2 = tr.make_data(model, 12, seed=1, dtype="float32")
        assert np.array_equal(x, x2) and np.array_equal(y, y2) and len(x) == len(y) == 12
    x, y = tr.make_data("cnn", 500, dtype="float32")
    assert x.shape == (500, 8, 8, 1) and x.dtype == np.float32 and y.dtype == np.int64
    assert set(np.unique(y)) == set(range(10))
    x, y = tr.make_data("transformer", 5)
    assert np.array_equal(x[:, 1:], y[:, :-1]) and x.max() < 32


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: tr.OptimConfig("lamb", 0.1), r"optimizer name='lamb' is unknown"),
        (lambda: tr.OptimConfig("sgd", 0.1, nesterov=True), r"nesterov=True needs .* momentum"),
        (lambda: tr.TrainConfig("resnet", SGD_MOMENTUM, 4), r"model='resnet' is not a reference"),
        (lambda: tr.TrainConfig("mlp", SGD_MOMENTUM, 4, accum_steps=0), r"accum_steps=0 must"),
        (lambda: tr.TrainConfig("mlp", SGD_MOMENTUM, 4, dtype="int8"), r"dtype='int8'"),
        (lambda: tr.TrainConfig(tr.MLP, SGD_MOMENTUM, 4), r"user's model: give its loss"),
        (lambda: tr.TrainConfig(tr.MLP, SGD_MOMENTUM, 4, loss="hinge"), r"loss='hinge' must"),
        (lambda: tr.load_attr("torch_ref.models:Nope"), r"has no attribute 'Nope'"),
    ],
)
def test_config_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_user_model_and_loss_train_as_the_reference_model():
    """A user's model by spec or class, with a named or own loss: the reference MLP's
    run, bitwise."""
    config = tr.TrainConfig("mlp", SGD_MOMENTUM, 4, accum_steps=2, max_steps=3)
    data, state = tr.make_data("mlp", 32), initial_state("mlp")
    reference = tr.train_ga(config, data, state)
    for model, loss in (
        ("torch_ref.models:MLP", "cross_entropy"),
        (tr.MLP, torch.nn.CrossEntropyLoss()),
    ):
        run = tr.train_ga(dataclasses.replace(config, model=model, loss=loss), data, state)
        for key, value in reference.final.items():
            np.testing.assert_array_equal(run.final[key], value, err_msg=key)
        assert run.losses == reference.losses


def test_run_errors():
    data, state = tr.make_data("mlp", 16), initial_state("mlp")
    two = tr.TrainConfig("mlp", SGD_MOMENTUM, 4, num_devices=2)
    with pytest.raises(ValueError, match=r"train_ga runs one process: num_devices=2 must be 1"):
        tr.train_ga(two, data, state)
    one = dataclasses.replace(two, num_devices=1)
    with pytest.raises(ValueError, match=r"mix \(num_devices, device\) layouts"):
        tr.train_ddp_many([(one, data, state), (two, data, state)])
    with pytest.raises(ValueError, match=r"launcher='mpirun'"):
        tr.train_ddp(two, data, state, launcher="mpirun")
    with pytest.raises(ValueError, match=r"micro-batches .* fewer than accum_steps=5"):
        tr.train_ga(dataclasses.replace(one, accum_steps=5), data, state)
    with pytest.raises(ValueError, match=r"missing \['fc3.bias'\].*mis-shaped .*'fc1.weight'"):
        bad = {k: v for k, v in state.items() if k != "fc3.bias"} | {"fc1.weight": np.ones(3)}
        tr.train_ga(one, data, bad)
    with pytest.raises(ValueError, match=r"x has 16 rows but y has 3"):
        tr.train_ga(one, (data[0], data[1][:3]), state)


PARITY_PAGE = pathlib.Path(__file__).parent.parent / "docs" / "parity.md"


def test_docs_torch_ref_example_runs(tmp_path):
    """docs/parity.md's torch_ref example, on its own (tests/test_docs.py runs the others)."""
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", PARITY_PAGE.read_text(), re.S)
                if "import torch_ref" in b]  # fmt: skip
    script = tmp_path / "torch_ref_docs.py"
    script.write_text(block)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    assert out.count("[[0.9472 0.944  0.9527 0.9687 0.957  0.9343 0.9411 0.9186]]") == 2, out

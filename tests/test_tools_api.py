"""The tools' public names (jaxdp.models, jaxdp.parity, jaxdp.plan), each held to what it
promises; the checkpoint and command-line names are exercised in their own tests."""

import dataclasses

import numpy as np
import optax
import pytest
import torch
from flax import nnx

import jaxdp
from jaxdp.models import (
    CNN,
    CNNBN,
    LAYER_NORM_EPS,
    MLP,
    MODELS,
    EmbedBranch,
    LinearModel,
    Stack,
    Transformer,
    build_model,
)
from jaxdp.parity import (
    ATOL,
    OPTIMIZERS,
    RTOL,
    OptimizerSpec,
    ParamGroup,
    ParityConfig,
    ParityReport,
    clip_grad_norm_like_torch,
    optax_like_torch,
    run_parity,
)
from jaxdp.plan import (
    DTYPE_POLICIES,
    OPTIMIZER_MOMENTS,
    CompiledMemory,
    DtypePolicy,
    MemoryPlan,
    compiled_memory,
    plan_memory,
)


def test_models_are_built_by_name_as_their_classes():
    classes = {
        "linear": LinearModel,
        "mlp": MLP,
        "cnn": CNN,
        "transformer": Transformer,
        "cnn_bn": CNNBN,
        "embed_branch": EmbedBranch,
        "stack": Stack,
    }
    assert sorted(MODELS) == sorted(classes)
    for name, cls in classes.items():
        # Abstract: the classes and their parameters' shapes, no arrays computed.
        assert isinstance(nnx.eval_shape(lambda name=name: build_model(name)), cls)
    # The one reference model with frozen parameters: its embedding, as torch_ref's.
    assert sorted(jaxdp.models.TRAINABLE) == ["embed_branch"]
    frozen = jaxdp.models.TRAINABLE["embed_branch"]
    assert not frozen(("embed", "embedding"), None) and frozen(("head", "kernel"), None)


def test_layer_norm_epsilon_is_torchs_default():
    assert torch.nn.LayerNorm(4).eps == LAYER_NORM_EPS


def test_tolerances_name_both_dtypes_and_float64_is_tighter():
    assert set(RTOL) == set(ATOL) == {"float32", "float64"}
    assert RTOL["float64"] < RTOL["float32"] and ATOL["float64"] < ATOL["float32"]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optax_like_torch_takes_torchs_step(name):
    spec = OPTIMIZERS[name]
    w0 = np.array([0.5, -1.0, 2.0])
    grads = [np.array([0.1, 0.2, -0.3]), np.array([-0.2, 0.05, 0.4])]
    param = torch.nn.Parameter(torch.tensor(w0))
    kwargs = dict(lr=spec.learning_rate, weight_decay=spec.weight_decay)
    if spec.name == "sgd":
        opt = torch.optim.SGD([param], momentum=spec.momentum, nesterov=spec.nesterov, **kwargs)
    else:
        opt = torch.optim.AdamW([param], betas=(spec.b1, spec.b2), eps=spec.eps, **kwargs)
    tx, w = optax_like_torch(spec), w0.copy()
    state = tx.init(w)
    for g in grads:
        param.grad = torch.tensor(g)
        if spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([param], spec.max_grad_norm)
        opt.step()
        updates, state = tx.update(g, state, w)
        w = optax.apply_updates(w, updates)
    np.testing.assert_allclose(w, param.detach().numpy(), rtol=1e-12, atol=1e-15)


TWO_GROUPS = {
    "adamw": OptimizerSpec(
        "adamw",
        1e-2,
        weight_decay=0.1,
        max_grad_norm=0.3,
        groups=(ParamGroup(("b",), learning_rate=3e-2, weight_decay=0.0),),
    ),
    "sgd": OptimizerSpec(
        "sgd",
        0.05,
        momentum=0.9,
        weight_decay=1e-2,
        groups=(ParamGroup(lambda name: name == "b", weight_decay=0.0),),
    ),
}


@pytest.mark.parametrize("name", sorted(TWO_GROUPS))
def test_optax_like_torch_takes_torchs_step_with_parameter_groups_and_a_schedule(name):
    """torch's two groups (the second: its own rate, no decay) under one LambdaLR against
    optax_like_torch's multi_transform, its schedule the first group's rate; torch_ref
    builds torch's groups from the same spec's fields."""
    import torch_ref

    spec = TWO_GROUPS[name]
    params = {"w": np.array([0.5, -1.0, 2.0]), "b": np.array([0.3, -0.2])}
    grads = [
        {k: np.cos(np.arange(len(v)) + i + len(k)) for k, v in params.items()} for i in range(3)
    ]
    model = torch.nn.ParameterDict(
        {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    )
    config = torch_ref.OptimConfig(**dataclasses.asdict(spec))
    opt = torch_ref.build_optimizer(model.named_parameters(), config)
    held = [[id(p) for p in g["params"]] for g in opt.param_groups]
    assert held == [[id(model["w"])], [id(model["b"])]]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 / (i + 1))
    tx = optax_like_torch(spec, lambda count: spec.learning_rate / (count + 1))
    state, w = tx.init(params), dict(params)
    for g in grads:
        for k, p in model.items():
            p.grad = torch.tensor(g[k])
        if spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        opt.step()
        scheduler.step()
        updates, state = tx.update(g, state, w)
        w = optax.apply_updates(w, updates)
    for k, p in model.items():
        np.testing.assert_allclose(w[k], p.detach().numpy(), rtol=1e-12, atol=1e-15)


def test_parameter_groups_refuse_names_the_tree_has_not_and_a_name_twice():
    spec = OptimizerSpec("adamw", 1e-2, groups=(ParamGroup(("head.bias",), weight_decay=0.0),))
    with pytest.raises(
        ValueError, match=r"groups\[0\] holds \['head.bias'\], and the .*: \['b', 'w'\]"
    ):
        optax_like_torch(spec).init({"w": np.zeros(2), "b": np.zeros(1)})
    with pytest.raises(ValueError, match=r"groups\[1\] holds \['b'\], which an earlier group"):
        OptimizerSpec("sgd", 0.1, groups=(ParamGroup(("b",)), ParamGroup(("b", "w"))))
    with pytest.raises(ValueError, match=r"params=\(\) must be a non-empty tuple"):
        ParamGroup(())


def _torch_optimizer(name, **kwargs):
    param = torch.nn.Parameter(torch.zeros(2))
    if name == "sgd":
        return torch.optim.SGD([param], **kwargs)
    return torch.optim.AdamW([param], **kwargs)


@pytest.mark.parametrize(
    ("name", "fields", "rule", "torch_kwargs"),
    [
        ("sgd", {"learning_rate": float("nan")}, r"learning_rate=nan must be", None),
        ("adamw", {"learning_rate": float("inf")}, r"learning_rate=inf must be", None),
        ("sgd", {"learning_rate": -0.1}, r"learning_rate=-0\.1 must be .* >= 0", {"lr": -0.1}),
        ("sgd", {"momentum": -0.5}, r"momentum=-0\.5 must be", {"lr": 0.1, "momentum": -0.5}),
        ("sgd", {"weight_decay": -1.0}, r"weight_decay=-1\.0", {"lr": 0.1, "weight_decay": -1.0}),
        ("adamw", {"eps": -1e-8}, r"eps=-1e-08 must be", {"lr": 0.1, "eps": -1e-8}),
        ("adamw", {"b1": 1.0}, r"b1=1\.0 must be .* in \[0, 1\)", {"lr": 0.1, "betas": (1.0, 0.9)}),
        ("adamw", {"b2": float("nan")}, r"b2=nan must be", None),
        ("sgd", {"max_grad_norm": -1.0}, r"max_grad_norm=-1\.0 must be .* > 0", None),
        (
            "sgd",
            {"nesterov": True},
            r"nesterov=True needs momentum > 0, got momentum=0\.0",
            {"lr": 0.1, "nesterov": True},
        ),
        ("rmsprop", {}, r"name='rmsprop' must be 'sgd' or 'adamw'", None),
    ],
)
def test_optimizer_spec_refuses_what_torch_or_arithmetic_forbids(name, fields, rule, torch_kwargs):
    with pytest.raises(ValueError, match=rule):
        OptimizerSpec(name, **({"learning_rate": 0.1} | fields))
    if torch_kwargs is not None:  # where torch.optim forbids it too (it takes NaN and Inf)
        with pytest.raises(ValueError):
            _torch_optimizer(name, **torch_kwargs)


def test_clip_like_torch_scales_as_clip_grad_norm():
    g = np.array([3.0, 4.0])  # norm 5
    clipped, _ = clip_grad_norm_like_torch(1.0).update(g, optax.EmptyState())
    tensor = torch.tensor(g)
    tensor.grad = tensor.clone()
    torch.nn.utils.clip_grad_norm_([tensor], 1.0)
    np.testing.assert_allclose(clipped, tensor.grad.numpy(), rtol=1e-15)


def test_run_parity_reports_every_step():
    report = run_parity(
        ParityConfig(model="linear", optimizer="sgd_momentum", num_devices=1, steps=3)
    )
    assert isinstance(report, ParityReport)
    assert report.passed and len(report.max_abs) == 3


def test_plan_memory_counts_bytes_per_parameter_by_policy():
    assert isinstance(DTYPE_POLICIES["fp32"], DtypePolicy)
    assert OPTIMIZER_MOMENTS == {"adamw": 2, "sgd-momentum": 1, "sgd": 0}
    plan = plan_memory(params=10**6, device_memory="1GB", policy="fp32", optimizer="adamw")
    assert isinstance(plan, MemoryPlan)
    # fp32: weights 4 + gradients 4 + two moments of 4 bytes per parameter.
    assert (plan.weights, plan.gradients, plan.optimizer_state) == (4e6, 4e6, 8e6)


def test_compiled_memory_reads_xlas_analysis():
    step = jaxdp.make_train_step(
        lambda p, b: ((b @ p) ** 2).mean(), optax.sgd(0.1), mesh=jaxdp.data_mesh(1)
    )
    state = step.init(np.ones((256, 4), np.float32))
    memory = compiled_memory(step.compile(state, np.ones((8, 256), np.float32)))
    assert isinstance(memory, CompiledMemory)
    assert memory.arguments >= 256 * 4 * 4  # the parameters at least
    assert memory.total >= memory.arguments

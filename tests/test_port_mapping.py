"""jaxdp.parity's weight map from a torch model to its JAX port (Flax NNX, Flax Linen,
equinox): each standard layer's layout gives the torch layer's output, a mapping dict or
function overrides the rules, and every problem is reported (compare_models' training
runs are in parity_tests/test_parity_ports.py and test_parity_linen_equinox.py)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen, nnx
from torch import nn

from jaxdp.models import BatchNorm
from jaxdp.parity._mapping import build_weight_map


def convert(torch_model, jax_model, mapping=None):
    """The port with the torch model's weights (float64), through the weight map."""
    torch_model.double()
    weights = build_weight_map(torch_model, jax_model, mapping)
    return weights, weights.load(jax_model, torch_model.state_dict(), jnp.float64)


class Pair(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer


class Port(nnx.Module):
    def __init__(self, layer):
        self.layer = layer


RNGS = nnx.Rngs(0)
KEY = jax.random.key(0)
X = np.random.default_rng(0).normal(size=(2, 3, 4, 5, 6))
FEATURES = X[:, :, 0, 0, :]  # [2, 3, 6]: normalized over the last axis on both sides
LAYERS = {  # torch layer, NNX layer, input (torch's layout); NNX gets channels last
    "conv1d": (
        nn.Conv1d(3, 4, 3),
        nnx.Conv(3, 4, (3,), padding="VALID", rngs=RNGS),
        X[:, :, :, 0, 0],
    ),
    "conv3d": (
        nn.Conv3d(3, 2, (2, 3, 2)),
        nnx.Conv(3, 2, (2, 3, 2), padding="VALID", rngs=RNGS),
        X,
    ),
    "embedding": (
        nn.Embedding(7, 3),
        nnx.Embed(7, 3, param_dtype=jnp.float64, rngs=RNGS),  # it computes in its param_dtype
        np.array([[0, 6, 2]]),
    ),
    "group_norm": (
        nn.GroupNorm(1, 3),
        nnx.GroupNorm(3, num_groups=1, epsilon=1e-5, use_fast_variance=False, rngs=RNGS),
        X[:, :, :, 0, 0],
    ),
    "rms_norm": (
        nn.RMSNorm(6, eps=1e-6),
        nnx.RMSNorm(6, epsilon=1e-6, use_fast_variance=False, rngs=RNGS),
        FEATURES,
    ),
}
CHANNELS_LAST = {"conv1d", "conv3d", "group_norm"}  # NNX and Linen take NHWC


def torch_output(layer, x):
    torch.manual_seed(0)
    for p in layer.parameters():  # away from the defaults (GroupNorm's ones and zeros)
        p.data.normal_()
    return layer.double()(torch.as_tensor(x)).detach().numpy()


@pytest.mark.parametrize("name", LAYERS)
def test_standard_layers_convert_to_the_same_function(name):
    layer, twin, x = LAYERS[name]
    expected = torch_output(layer, x)
    _, port = convert(Pair(layer), Port(twin))
    if name in CHANNELS_LAST:
        x, expected = np.moveaxis(x, 1, -1), np.moveaxis(expected, 1, -1)
    got = np.asarray(port.layer(jnp.asarray(x)))
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


class LinenPort(linen.Module):
    layer: linen.Module

    def __call__(self, x):
        return self.layer(x)


LINEN_LAYERS = {  # torch layer, Linen layer, input (torch's layout)
    "linear": (nn.Linear(6, 4), linen.Dense(4), FEATURES),
    "conv2d": (nn.Conv2d(3, 2, (2, 3)), linen.Conv(2, (2, 3), padding="VALID"), X[..., 0]),
    "layer_norm": (nn.LayerNorm(6), linen.LayerNorm(1e-5, use_fast_variance=False), FEATURES),
    "rms_norm": (nn.RMSNorm(6, eps=1e-6), linen.RMSNorm(1e-6, use_fast_variance=False), FEATURES),
    "group_norm": (
        nn.GroupNorm(1, 3),
        linen.GroupNorm(num_groups=1, epsilon=1e-5, use_fast_variance=False),
        X[:, :, :, 0, 0],
    ),
    "embedding": (nn.Embedding(7, 3), linen.Embed(7, 3), np.array([[0, 6, 2]])),
}


@pytest.mark.parametrize("name", LINEN_LAYERS)
def test_linen_layers_convert_to_the_same_function(name):
    layer, twin, x = LINEN_LAYERS[name]
    expected = torch_output(layer, x)
    if name in ("conv2d", "group_norm"):
        x, expected = np.moveaxis(x, 1, -1), np.moveaxis(expected, 1, -1)
    module = LinenPort(twin)
    bound = module.bind(module.init(KEY, jnp.asarray(x)))
    _, port = convert(Pair(layer), bound)
    assert port.unbind()[1]["params"]["layer"].keys() == bound.variables["params"]["layer"].keys()
    np.testing.assert_allclose(np.asarray(port(jnp.asarray(x))), expected, rtol=1e-12, atol=1e-12)


def test_linen_batch_norm_statistics_come_from_torchs_buffers():
    torch_bn = Pair(nn.BatchNorm1d(3))
    torch_bn.layer.running_var.fill_(2.0)
    module = LinenPort(linen.BatchNorm(use_running_average=True))
    bound = module.bind(module.init(KEY, jnp.ones((2, 3))))
    weights, port = convert(torch_bn, bound)
    assert port.variables["batch_stats"]["layer"]["var"].tolist() == [2.0] * 3
    assert sorted(weights.params) == ["layer.bias", "layer.scale"]  # the statistics do not train


class EqxPort(eqx.Module):
    layer: eqx.Module


EQX_LAYERS = {  # torch layer, equinox layer (one example at a time), input (torch's layout)
    "linear": (nn.Linear(6, 4), eqx.nn.Linear(6, 4, key=KEY), FEATURES[:, 0]),
    "conv1d": (nn.Conv1d(3, 4, 3), eqx.nn.Conv1d(3, 4, 3, key=KEY), X[:, :, :, 0, 0]),
    "conv3d": (nn.Conv3d(3, 2, (2, 3, 2)), eqx.nn.Conv3d(3, 2, (2, 3, 2), key=KEY), X),
    "layer_norm": (nn.LayerNorm(6), eqx.nn.LayerNorm(6, eps=1e-5), FEATURES[:, 0]),
    "rms_norm": (nn.RMSNorm(6, eps=1e-6), eqx.nn.RMSNorm(6, 1e-6, use_bias=False), FEATURES[:, 0]),
    "group_norm": (nn.GroupNorm(1, 3), eqx.nn.GroupNorm(1, 3, eps=1e-5), X[:, :, :, 0, 0]),
    "embedding": (nn.Embedding(7, 3), eqx.nn.Embedding(7, 3, key=KEY), np.array([0, 6, 2])),
}


@pytest.mark.parametrize("name", EQX_LAYERS)
def test_equinox_layers_keep_torchs_layouts(name):
    layer, twin, x = EQX_LAYERS[name]
    expected = torch_output(layer, x)
    _, port = convert(Pair(layer), EqxPort(twin))
    got = np.asarray(jax.vmap(port.layer)(jnp.asarray(x)))
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_equinox_multihead_attention_takes_in_proj_as_query_key_value_proj():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(4, 2, batch_first=True).double()
    twin = eqx.nn.MultiheadAttention(
        2,
        4,
        use_query_bias=True,
        use_key_bias=True,
        use_value_bias=True,
        use_output_bias=True,
        key=KEY,
    )
    _, port = convert(Pair(mha), EqxPort(twin))
    x = np.random.default_rng(1).normal(size=(2, 3, 4))
    expected = mha(*[torch.as_tensor(x)] * 3, need_weights=False)[0].detach().numpy()
    got = jax.vmap(lambda t: port.layer(t, t, t))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-12, atol=1e-12)


def test_ports_that_cannot_be_compared_are_refused_with_the_reason():
    with pytest.raises(TypeError, match=r"jax_model is a Dense, not .* a bound Linen module"):
        convert(Pair(nn.Linear(2, 2)), linen.Dense(2))  # not bound: no variables yet
    rms = Pair(nn.RMSNorm(3))
    with pytest.raises(ValueError, match=r"layer.bias \(3,\): no torch tensor fills it"):
        convert(rms, EqxPort(eqx.nn.RMSNorm(3)))  # equinox's RMSNorm has a bias by default


def test_multihead_attention_splits_in_proj_into_query_key_value():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(4, 2, batch_first=True)
    _, port = convert(Pair(mha), Port(nnx.MultiHeadAttention(2, 4, decode=False, rngs=RNGS)))
    w = mha.in_proj_weight.detach().numpy()
    np.testing.assert_array_equal(port.layer.key.kernel[...], w[4:8].T.reshape(4, 2, 2))
    np.testing.assert_array_equal(
        port.layer.out.kernel[...], mha.out_proj.weight.detach().numpy().T.reshape(2, 2, 4)
    )


def test_batch_norm_buffers_map_to_torchs_names_or_flaxs():
    torch_bn = Pair(nn.BatchNorm1d(3))
    torch_bn.layer.running_var.fill_(2.0)
    _, ours = convert(torch_bn, Port(BatchNorm(3)))
    assert ours.layer.running_var[...].tolist() == [2.0] * 3
    assert int(ours.layer.num_batches_tracked[...]) == 0
    # flax's names; its BatchNorm has no counter, so torch's is left out.
    _, flax = convert(torch_bn, Port(nnx.BatchNorm(3, rngs=RNGS)))
    assert flax.layer.var[...].tolist() == [2.0] * 3


class Renamed(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(3, 3, rngs=RNGS)


def test_mapping_dict_and_function_override_the_rules():
    torch_model = Pair(nn.Linear(3, 3))
    w = torch_model.layer.weight.detach().numpy().astype(np.float64)
    renamed = Renamed()
    mapping = {"layer.weight": "dense.kernel", "layer.bias": "dense.bias"}
    _, port = convert(torch_model, renamed, mapping)
    np.testing.assert_array_equal(port.dense.kernel[...], w.T)  # still Linear's transpose
    _, port = convert(torch_model, renamed, {**mapping, "layer.weight": ("dense.kernel", np.copy)})
    np.testing.assert_array_equal(port.dense.kernel[...], w)

    def function(state_dict):
        return {
            "dense.kernel": state_dict["layer.weight"].T,
            "dense.bias": state_dict["layer.bias"],
        }

    weights, port = convert(torch_model, renamed, function)
    np.testing.assert_array_equal(port.dense.kernel[...], w.T)
    with pytest.raises(ValueError, match=r"layer.bias \(3,\): never read"):
        convert(torch_model, renamed, lambda sd: {"dense.kernel": sd["layer.weight"].T})


def test_frozen_torch_parameters_are_named_in_the_port():
    torch_model = Pair(nn.Linear(2, 2))
    torch_model.layer.bias.requires_grad_(False)
    port = Port(nnx.Linear(2, 2, rngs=RNGS))
    weights, _ = convert(torch_model, port)
    assert weights.frozen == {"layer.bias"}

    def function(state_dict):
        return {
            "layer.kernel": state_dict["layer.weight"].T,
            "layer.bias": state_dict["layer.bias"],
        }

    weights, _ = convert(torch_model, port, function)
    assert weights.frozen == {"layer.bias"}

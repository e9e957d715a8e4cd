"""torch state_dict <-> jaxdp parameters: layouts, round trips and errors."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxdp


@pytest.mark.parametrize("name", sorted(jaxdp.models.MODELS))
def test_round_trip_is_exact(name):
    model = jaxdp.models.build_model(name, param_dtype=jnp.float64)
    state_dict = {k: v * 3 + 1 for k, v in jaxdp.params_to_torch(model).items()}
    again = jaxdp.params_to_torch(jaxdp.torch_to_params(state_dict, model))
    assert again.keys() == state_dict.keys()
    for key, value in state_dict.items():
        np.testing.assert_array_equal(again[key], value, err_msg=key)


def test_layouts_match_torch_layers():
    torch.manual_seed(0)  # independent of what ran before in this process
    linear, conv = torch.nn.Linear(3, 5), torch.nn.Conv2d(2, 4, (3, 1))
    params = {
        "fc": {"kernel": np.zeros((3, 5)), "bias": np.zeros(5)},
        "conv": {"kernel": np.zeros((3, 1, 2, 4)), "bias": np.zeros(4)},
    }
    state_dict = {f"fc.{k}": v for k, v in linear.state_dict().items()}
    state_dict |= {f"module.conv.{k}": v for k, v in conv.state_dict().items()}  # DDP prefix
    out = jaxdp.torch_to_params(state_dict, params)
    np.testing.assert_array_equal(out["fc"]["kernel"], linear.weight.detach().numpy().T)
    np.testing.assert_array_equal(
        out["conv"]["kernel"], conv.weight.detach().numpy().transpose(2, 3, 1, 0)
    )
    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    np.testing.assert_allclose(
        x @ out["fc"]["kernel"] + out["fc"]["bias"],
        linear(torch.from_numpy(x)).detach().numpy(),
        rtol=1e-6,
        atol=1e-6,  # float32 outputs near 0: numpy and torch add the products in another order
    )


def test_layer_norm_and_embedding_names():
    model = jaxdp.models.build_model("transformer")
    keys = jaxdp.params_to_torch(model).keys()
    assert {"block.ln1.weight", "block.ln1.bias", "tok_emb.weight", "pos_emb.weight"} <= keys
    assert "head.bias" not in keys


def test_input_module_is_not_changed():
    model = jaxdp.models.build_model("mlp")
    before = jaxdp.params_to_torch(model)
    jaxdp.torch_to_params({k: v + 1 for k, v in before.items()}, model)
    for key, value in jaxdp.params_to_torch(model).items():
        np.testing.assert_array_equal(value, before[key])


def test_missing_tensor_is_named():
    model = jaxdp.models.build_model("mlp")
    state_dict = jaxdp.params_to_torch(model)
    del state_dict["fc2.weight"]
    with pytest.raises(KeyError, match=r"no 'fc2.weight' for parameter fc2.kernel of shape"):
        jaxdp.torch_to_params(state_dict, model)


def test_misshaped_tensor_is_named():
    model = jaxdp.models.build_model("mlp")
    state_dict = jaxdp.params_to_torch(model)
    state_dict["fc1.weight"] = state_dict["fc1.weight"].T  # forgot torch's [out, in]
    with pytest.raises(
        ValueError,
        match=r"state_dict\['fc1.weight'\] has shape \(16, 32\); parameter fc1.kernel of shape "
        r"\(16, 32\) needs a torch tensor of shape \(32, 16\)",
    ):
        jaxdp.torch_to_params(state_dict, model)


def test_unexpected_tensor_is_refused():
    model = jaxdp.models.build_model("linear")
    state_dict = jaxdp.params_to_torch(model) | {"linear.bias": np.zeros(1)}
    with pytest.raises(ValueError, match=r"no matching parameter: \['linear.bias'\]"):
        jaxdp.torch_to_params(state_dict, model)

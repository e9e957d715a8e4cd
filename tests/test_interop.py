"""torch modules and state_dicts <-> jaxdp parameters: layouts, round trips and errors."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxdp
from jaxdp.parity import params_to_torch, torch_to_params


@pytest.mark.parametrize("name", sorted(jaxdp.models.MODELS))
def test_round_trip_is_exact(name):
    model = jaxdp.models.build_model(name, param_dtype=jnp.float64)
    state_dict = {k: v * 3 + 1 for k, v in params_to_torch(model).items()}
    again = params_to_torch(torch_to_params(state_dict, model, layouts="out_in"))
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
    out = torch_to_params(state_dict, params)
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
    keys = params_to_torch(model).keys()
    assert {"block.ln1.weight", "block.ln1.bias", "tok_emb.weight", "pos_emb.weight"} <= keys
    assert "head.bias" not in keys


def test_input_module_is_not_changed():
    model = jaxdp.models.build_model("mlp")
    before = params_to_torch(model)
    torch_to_params({k: v + 1 for k, v in before.items()}, model, layouts="out_in")
    for key, value in params_to_torch(model).items():
        np.testing.assert_array_equal(value, before[key])


def test_missing_tensor_is_named():
    model = jaxdp.models.build_model("mlp")
    state_dict = params_to_torch(model)
    del state_dict["fc2.weight"]
    with pytest.raises(KeyError, match=r"no 'fc2.weight' for parameter fc2.kernel of shape"):
        torch_to_params(state_dict, model)


def test_misshaped_tensor_is_named():
    model = jaxdp.models.build_model("mlp")
    state_dict = params_to_torch(model)
    state_dict["fc1.weight"] = state_dict["fc1.weight"].T  # forgot torch's [out, in]
    with pytest.raises(
        ValueError,
        match=r"state_dict\['fc1.weight'\] has shape \(16, 32\); parameter fc1.kernel of shape "
        r"\(16, 32\) needs a torch tensor of shape \(32, 16\)",
    ):
        torch_to_params(state_dict, model)


def test_unexpected_tensor_is_refused():
    model = jaxdp.models.build_model("linear")
    state_dict = params_to_torch(model) | {"linear.bias": np.zeros(1)}
    with pytest.raises(ValueError, match=r"no matching parameter: \['linear.bias'\]"):
        torch_to_params(state_dict, model)


def test_a_torch_module_gives_each_layer_its_layout():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv1d(2, 4, 3), torch.nn.Linear(5, 5))
    params = {
        "0": {"kernel": np.zeros((3, 2, 4)), "bias": np.zeros(4)},
        "1": {"kernel": np.zeros((5, 5)), "bias": np.zeros(5)},  # square: the module tells
    }
    out = torch_to_params(net, params)
    np.testing.assert_array_equal(
        out["0"]["kernel"], net[0].weight.detach().numpy().transpose(2, 1, 0)
    )
    np.testing.assert_array_equal(out["1"]["kernel"], net[1].weight.detach().numpy().T)
    again = params_to_torch(out, net)
    for key, value in net.state_dict().items():
        np.testing.assert_array_equal(again[key], value.numpy(), err_msg=key)


def test_a_square_kernel_of_a_bare_state_dict_is_refused_naming_it():
    state_dict = {"attn.c_proj.weight": np.eye(4), "attn.c_proj.bias": np.zeros(4)}
    params = {"attn": {"c_proj": {"kernel": np.zeros((4, 4)), "bias": np.zeros(4)}}}
    with pytest.raises(
        ValueError,
        match=r"state_dict\['attn.c_proj.weight'\] \(4, 4\) for the square kernel "
        r"attn.c_proj.kernel \(4, 4\): its shape cannot tell nn.Linear's \[out, in\] from "
        r"transformers' Conv1D's \[in, out\] and a state_dict does not say; pass the torch "
        r"module .* or layouts=\{'attn.c_proj.weight': 'out_in' or 'in_out'\}",
    ):
        torch_to_params(state_dict, params)
    w = np.arange(16.0).reshape(4, 4)
    named = torch_to_params(
        state_dict | {"attn.c_proj.weight": w}, params, layouts={"attn.c_proj.weight": "in_out"}
    )
    np.testing.assert_array_equal(named["attn"]["c_proj"]["kernel"], w)


def test_layouts_that_name_no_tensor_or_no_layout_are_refused():
    state_dict = {"fc.weight": np.zeros((3, 2)), "fc.bias": np.zeros(3)}
    params = {"fc": {"kernel": np.zeros((2, 3)), "bias": np.zeros(3)}}
    with pytest.raises(ValueError, match=r"layouts names 'fc.kernel', which is no tensor"):
        torch_to_params(state_dict, params, layouts={"fc.kernel": "in_out"})
    with pytest.raises(ValueError, match=r"layouts\['fc.weight'\]='linear' must be one of"):
        torch_to_params(state_dict, params, layouts={"fc.weight": "linear"})


def test_the_old_names_warn_and_keep_reading_kernels_as_linear():
    assert "torch_to_params" not in jaxdp.__all__ and "params_to_torch" not in jaxdp.__all__
    model = jaxdp.models.build_model("transformer", param_dtype=jnp.float64)  # square kernels
    with pytest.warns(
        DeprecationWarning, match=r"jaxdp.params_to_torch is deprecated: use jaxdp.parity"
    ):
        old_params_to_torch = jaxdp.params_to_torch
    with pytest.warns(
        DeprecationWarning, match=r"use jaxdp.parity.torch_to_params \(moved in jaxdp 0.3"
    ):
        old_torch_to_params = jaxdp.torch_to_params
    state_dict = {k: v + 1 for k, v in old_params_to_torch(model).items()}
    again = params_to_torch(old_torch_to_params(state_dict, model))
    for key, value in state_dict.items():
        np.testing.assert_array_equal(again[key], value, err_msg=key)


# ---- a Hugging Face checkpoint (transformers' Conv1D) into an NNX port ------------------------


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A 2-layer float64 GPT-2 built here (no download), saved and loaded as HF does."""
    import hf_gpt2
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    checkpoint = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(hf_gpt2.tiny_config()).save_pretrained(checkpoint)
    return checkpoint, hf_gpt2.GPT2Logits.from_pretrained(checkpoint, dtype=torch.float64)


def _port():
    from flax import nnx
    from hf_gpt2 import GPT2Port, tiny_config

    return GPT2Port(tiny_config(), rngs=nnx.Rngs(0), param_dtype=jnp.float64)


def _logits(port, hf):
    """(the port's logits, the HF model's) on the same token ids, both float64."""
    ids = np.random.default_rng(0).integers(0, 64, size=(3, 10))
    want = hf(torch.from_numpy(ids)).detach().numpy()
    got = np.asarray(port(ids))
    assert got.dtype == want.dtype == np.float64
    return got, want


def test_a_hf_gpt2_loads_into_an_nnx_port_with_its_logits(gpt2):
    _, hf = gpt2
    got, want = _logits(torch_to_params(hf, _port()), hf)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


def test_a_hf_gpt2_safetensors_file_needs_the_square_projections_layout(gpt2):
    from safetensors.numpy import load_file

    checkpoint, hf = gpt2
    state_dict = load_file(checkpoint / "model.safetensors")
    conv1d = [
        k for k in state_dict if k.endswith(("c_attn.weight", "c_fc.weight", "c_proj.weight"))
    ]
    not_square = {k: "in_out" for k in conv1d if ".attn.c_proj." not in k}
    with pytest.raises(
        ValueError,
        match=r"state_dict\['transformer.h.0.attn.c_proj.weight'\] \(16, 16\) for the square",
    ):
        torch_to_params(state_dict, _port(), layouts=not_square)
    port = torch_to_params(state_dict, _port(), layouts=dict.fromkeys(conv1d, "in_out"))
    got, want = _logits(port, hf)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


def test_params_to_torch_writes_a_hf_model_in_its_own_layout(gpt2):
    _, hf = gpt2
    port = torch_to_params(hf, _port())
    out = params_to_torch(port, hf)
    assert out.keys() == hf.state_dict().keys()  # the tied lm_head.weight too
    for key, value in hf.state_dict().items():
        np.testing.assert_array_equal(out[key], value.numpy(), err_msg=key)

"""The reference GPT in scanned-layer form computes what the unscanned one computes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdp.models import ScannedTransformer, Transformer, stack_blocks

VOCAB, T = 32, 8


def tokens(seed=1, rows=6):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, VOCAB, size=(rows, T)))


def loss(model, x):
    # Next-token cross-entropy: every position's logits against the following token.
    logits = model(x)[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()


def unrolled(model, x):
    """The scanned model's blocks applied one after the other in Python, no scan."""
    h = model.tok_emb(x) + model.pos_emb(jnp.arange(x.shape[1]))
    graphdef, state = nnx.split(model.blocks)
    for i in range(jax.tree.leaves(state)[0].shape[0]):
        h = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))(h)
    return model.head(model.ln_f(h))


def test_one_scanned_block_is_the_transformer_with_its_weights_stacked():
    with jax.enable_x64(True):
        plain = Transformer(rngs=nnx.Rngs(0), param_dtype=jnp.float64)
        scanned = ScannedTransformer(n_layers=1, rngs=nnx.Rngs(7), param_dtype=jnp.float64)
        params = nnx.state(scanned, nnx.Param)
        nnx.replace_by_pure_dict(params, stack_blocks(nnx.state(plain, nnx.Param), ["block"]))
        nnx.update(scanned, params)
        x = tokens()
        expected, expected_grads = nnx.jit(nnx.value_and_grad(loss))(plain, x)
        got, grads = nnx.jit(nnx.value_and_grad(loss))(scanned, x)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, expected, rtol=1e-14)
        want = stack_blocks(expected_grads, ["block"])
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15),
            nnx.to_pure_dict(grads),
            want,
        )


def test_the_scan_over_three_blocks_is_the_python_loop_over_them():
    with jax.enable_x64(True):
        model = ScannedTransformer(n_layers=3, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
        x = tokens()
        kernel = model.blocks.attn.query.kernel[...]
        assert kernel.shape == (3, 16, 16)  # one leading layer axis, blocks that differ
        assert not np.allclose(kernel[0], kernel[1])
        # The layers in order, each its own (the gradients through the scan: the test above).
        np.testing.assert_allclose(model(x), unrolled(model, x), rtol=1e-13, atol=1e-15)


def test_bad_layer_counts_and_block_names_are_refused():
    with pytest.raises(ValueError, match=r"n_layers=0 must be at least 1"):
        ScannedTransformer(n_layers=0, rngs=nnx.Rngs(0))
    state = nnx.state(Transformer(rngs=nnx.Rngs(0)), nnx.Param)
    with pytest.raises(ValueError, match=r"blocks=\['blocks'\]: \['blocks'\] not in the state"):
        stack_blocks(state, ["blocks"])


def test_a_compute_dtype_casts_each_block_inside_the_loop():
    """bfloat16 compute over float32 parameters: the scan takes the stacked float32
    leaves and casts inside its body (at stage 3 after a layer's gather; a cast before
    the loop would gather the whole stack); the logits come out in bfloat16."""
    model = ScannedTransformer(n_layers=2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = tokens()
    graphdef, params = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(x))(params)
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    stacked = [v.aval for v in scan.invars if v.aval.ndim and v.aval.shape[0] == 2]
    assert stacked and {a.dtype for a in stacked} == {jnp.dtype(jnp.float32)}, stacked
    assert jaxpr.out_avals[0].dtype == jnp.bfloat16

"""A model's own sharding names on a mesh axis the mesh lacks (a tensor-parallel "model"
on a data mesh) are refused when the step is given the model, naming the leaf, the axis
and the mesh's axes: jaxdp's step places every parameter over its data axes by its own
rule over its data axes, so the leaf would not have been split over that axis, without a
word (issue 49).
Names of the mesh's own axes, of a stack's layer axis, and logical names that the
model's rules map to no axis are taken, and train as the model without them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxdp
from jaxdp.testing import assert_trees_close


class NnxMLP(nnx.Module):
    def __init__(self, names):
        rngs = nnx.Rngs(0)
        meta = {} if names is None else {"out_sharding": names, "eager_sharding": False}
        self.fc1 = nnx.Linear(4, 8, rngs=rngs, kernel_metadata=meta)
        self.fc2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def nnx_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


class LinenDense(nn.Module):
    names: tuple | None
    logical: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        if self.names is not None:
            wrap = nn.with_logical_partitioning if self.logical else nn.with_partitioning
            init = wrap(init, self.names)
        return jnp.tanh(x @ self.param("w", init, (4, 2)))


def batch():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32)


def make_step(loss):
    return jaxdp.make_train_step(loss, optax.sgd(0.1), mesh=jaxdp.data_mesh(2))


def linen(names, logical=False):
    module = LinenDense(names, logical)
    params = module.init(jax.random.key(0), jnp.ones((1, 4)))["params"]

    def loss(p, batch):
        x, y = batch
        return jnp.mean((module.apply({"params": p}, x) - y) ** 2)

    return params, loss


def trained(step, model):
    state, _ = step(step.init(model), batch())
    return jax.device_get(jax.tree.leaves(step.model(state)))


def test_an_nnx_kernel_split_over_a_model_axis_is_refused_on_a_data_mesh():
    step = make_step(nnx_loss)
    with pytest.raises(ValueError) as refused:
        step.init(NnxMLP((None, "model")))
    said = str(refused.value)
    assert "params['fc1']['kernel']'s sharding metadata ((None, 'model'))" in said, said
    assert "names the mesh axis 'model', which the mesh lacks (its axes: ('data',))" in said
    assert "by its own rule over the mesh's data axes only" in said


@pytest.mark.parametrize("names", [(None, None), ("data", None)])
def test_names_of_the_meshs_own_axes_train_as_the_model_without_them(names):
    annotated = trained(make_step(nnx_loss), NnxMLP(names))
    assert_trees_close(annotated, trained(make_step(nnx_loss), NnxMLP(None)))


def test_a_linen_param_with_partitioning_over_a_model_axis_is_refused():
    params, loss = linen((None, "model"))
    with pytest.raises(
        ValueError, match=r"params\['w'\]'s sharding metadata \(\(None, 'model'\)\)"
    ):
        make_step(loss).init(params)


def test_logical_names_are_read_through_the_rules_in_force():
    """Linen's logical names map through ``nn.logical_axis_rules`` (in force when the
    step is given the model): to ``model`` refused, to no axis taken; the refusal says
    both the names and what they map to."""
    params, loss = linen(("embed", "mlp"), logical=True)
    with nn.logical_axis_rules([("mlp", "model")]), pytest.raises(ValueError) as refused:
        make_step(loss).init(params)
    assert "(('embed', 'mlp'), by its rules (None, 'model'))" in str(refused.value)
    with nn.logical_axis_rules([("mlp", None)]):
        annotated = trained(make_step(loss), params)
    plain, plain_loss = linen(None)
    assert_trees_close(annotated, trained(make_step(plain_loss), plain))


def test_nnx_logical_names_are_read_as_nnx_reads_them():
    """An NNX Variable's names map through the ``nnx.logical_axis_rules`` in force (and
    its own ``sharding_rules``) as ``nnx.get_partition_spec`` maps them: to ``model``
    refused, to no axis taken; a name no rule maps stays a mesh axis name, as NNX
    places it, and is refused when the mesh lacks it."""
    step = make_step(nnx_loss)
    model = NnxMLP(("embed", "mlp"))
    rules = [("embed", None), ("mlp", "model")]
    with nnx.logical_axis_rules(rules), pytest.raises(ValueError) as refused:
        step.init(model)
    assert "(('embed', 'mlp'), by its rules (None, 'model'))" in str(refused.value)
    with pytest.raises(ValueError, match="names the mesh axis 'embed'"):
        step.init(model)
    with nnx.logical_axis_rules([("embed", None), ("mlp", None)]):
        annotated = trained(step, model)
    assert_trees_close(annotated, trained(make_step(nnx_loss), NnxMLP(None)))


def test_a_named_sharding_is_read_by_its_spec():
    """``out_sharding`` may be a ``NamedSharding`` (a mesh of its own): its spec's axes
    are the names, refused on a mesh that lacks them."""
    devices = np.array(jax.devices()[:1]).reshape(1, 1)
    theirs = jax.sharding.NamedSharding(
        jax.sharding.Mesh(devices, ("data", "model")), jax.sharding.PartitionSpec(None, "model")
    )
    with pytest.raises(ValueError, match=r"\(\(None, 'model'\)\) names the mesh axis 'model'"):
        make_step(nnx_loss).init(NnxMLP(theirs))

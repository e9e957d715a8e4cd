"""Reference models in Flax NNX, laid out like their twins in ``torch_ref.models``.

Attribute names are the torch module names, so the state_dict key
``block.attn.query.weight`` is the NNX parameter ``block.attn.query.kernel``
(see :func:`jaxdp.parity.torch_to_params`); ``stack``'s layers are stacked, so its
``blocks.fc.kernel`` ``[3, 12, 24]`` holds torch's ``blocks.0.fc.weight`` ...
``blocks.2.fc.weight``. Each model comes with its loss: the mean
over the micro-batch, except ``linear`` whose loss is the seed example's sum.
Batches are ``(x, y)``; images are NHWC.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from .._layers import scan_layers
from .._shards import name_layer_axis

LAYER_NORM_EPS = 1e-5
"""The reference models' LayerNorm epsilon: torch.nn.LayerNorm's default (flax's is 1e-6)."""


class LinearModel(nnx.Module):
    """The seed example: ``Linear(8, 1, bias=False)`` with all weights one."""

    def __init__(self, in_features: int = 8, *, param_dtype: Any = jnp.float32):
        self.linear = nnx.Linear(
            in_features,
            1,
            use_bias=False,
            kernel_init=nnx.initializers.ones,
            param_dtype=param_dtype,
            rngs=nnx.Rngs(0),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear(x)


class MLP(nnx.Module):
    """``fc1 -> relu -> fc2 -> relu -> fc3``: features to class logits."""

    def __init__(
        self,
        in_features: int = 16,
        hidden: int = 32,
        num_classes: int = 4,
        *,
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
    ):
        self.fc1 = nnx.Linear(in_features, hidden, param_dtype=param_dtype, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, hidden, param_dtype=param_dtype, rngs=rngs)
        self.fc3 = nnx.Linear(hidden, num_classes, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc3(jax.nn.relu(self.fc2(jax.nn.relu(self.fc1(x)))))


class CNN(nnx.Module):
    """Two 3x3 convolutions (ReLU; 2x2 max-pool after the first), global mean, linear head."""

    def __init__(
        self,
        in_channels: int = 1,
        channels: tuple[int, int] = (8, 16),
        num_classes: int = 10,
        *,
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
    ):
        conv = dict(
            kernel_size=(3, 3), padding=((1, 1), (1, 1)), param_dtype=param_dtype, rngs=rngs
        )
        self.conv1 = nnx.Conv(in_channels, channels[0], **conv)
        self.conv2 = nnx.Conv(channels[0], channels[1], **conv)
        self.head = nnx.Linear(channels[1], num_classes, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.conv1(x))
        b, height, width, c = h.shape
        h = h.reshape(b, height // 2, 2, width // 2, 2, c).max(axis=(2, 4))
        h = jax.nn.relu(self.conv2(h)).mean(axis=(1, 2))
        return self.head(h)


class BatchNorm(nnx.Module):
    """``torch.nn.BatchNorm1d/2d/3d`` over the last (feature) axis, with torch's buffers.

    Training: normalizes with the batch mean and BIASED variance (``eps``
    inside the square root) and updates ``running_mean`` and the UNBIASED
    ``running_var`` as ``(1 - momentum) * old + momentum * batch`` (torch's
    momentum: 0.1 here is flax's 0.9), over ``n`` values per feature: the
    micro-batch's rows times spatial positions on this device, or on all
    devices of ``axis_name`` (SyncBatchNorm: mean and variance are averaged
    over the axis; jaxdp sets it with ``batch_stats="sync"``).
    ``num_batches_tracked`` counts training forwards. With
    ``use_running_average`` (``model.eval()``) it normalizes with the running
    statistics. ``nnx.BatchNorm`` instead keeps the biased variance, so its
    ``var`` is torch's ``running_var * (n - 1) / n`` only for a constant ``n``.
    """

    def __init__(
        self,
        num_features: int,
        *,
        momentum: float = 0.1,
        epsilon: float = 1e-5,
        use_running_average: bool = False,
        axis_name: str | None = None,
        param_dtype: Any = jnp.float32,
    ):
        self.scale = nnx.Param(jnp.ones(num_features, param_dtype))
        self.bias = nnx.Param(jnp.zeros(num_features, param_dtype))
        self.running_mean = nnx.BatchStat(jnp.zeros(num_features, param_dtype))
        self.running_var = nnx.BatchStat(jnp.ones(num_features, param_dtype))
        self.num_batches_tracked = nnx.BatchStat(jnp.zeros([], jnp.int32))
        self.momentum = momentum
        self.epsilon = epsilon
        self.use_running_average = use_running_average
        self.axis_name = axis_name

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.use_running_average:
            mean, var = self.running_mean[...], self.running_var[...]
        else:
            axes = tuple(range(x.ndim - 1))
            n = math.prod(x.shape[:-1])
            mean = x.mean(axes)
            if self.axis_name is not None:
                mean = jax.lax.pmean(mean, self.axis_name)
            var = jnp.square(x - mean).mean(axes)  # two passes, as torch
            if self.axis_name is not None:
                var = jax.lax.pmean(var, self.axis_name)
                n *= jax.lax.axis_size(self.axis_name)
            m = self.momentum
            stats = jax.lax.stop_gradient((mean, var * (n / (n - 1))))
            self.running_mean[...] = (1 - m) * self.running_mean[...] + m * stats[0]
            self.running_var[...] = (1 - m) * self.running_var[...] + m * stats[1]
            self.num_batches_tracked[...] = self.num_batches_tracked[...] + 1
        return (x - mean) / jnp.sqrt(var + self.epsilon) * self.scale[...] + self.bias[...]


class CNNBN(nnx.Module):
    """:class:`CNN` with a :class:`BatchNorm` after each convolution (convolutions without
    bias: BatchNorm removes it, and its gradient would be rounding noise)."""

    def __init__(
        self,
        in_channels: int = 1,
        channels: tuple[int, int] = (8, 16),
        num_classes: int = 10,
        *,
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
    ):
        conv = dict(
            kernel_size=(3, 3),
            padding=((1, 1), (1, 1)),
            use_bias=False,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.conv1 = nnx.Conv(in_channels, channels[0], **conv)
        self.bn1 = BatchNorm(channels[0], param_dtype=param_dtype)
        self.conv2 = nnx.Conv(channels[0], channels[1], **conv)
        self.bn2 = BatchNorm(channels[1], param_dtype=param_dtype)
        self.head = nnx.Linear(channels[1], num_classes, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.bn1(self.conv1(x)))
        b, height, width, c = h.shape
        h = h.reshape(b, height // 2, 2, width // 2, 2, c).max(axis=(2, 4))
        h = jax.nn.relu(self.bn2(self.conv2(h))).mean(axis=(1, 2))
        return self.head(h)


class EmbedBranch(nnx.Module):
    """Tokens ``[B, T]`` -> mean embedding -> ``fc`` (ReLU) -> ``branch`` (residual,
    ReLU) only for micro-batches holding a row that starts with token 0 -> ``head``.

    The embedding is meant to stay frozen (``trainable=TRAINABLE["embed_branch"]``)
    and ``branch`` goes unused by every micro-batch without such a row.
    """

    def __init__(
        self,
        vocab_size: int = 16,
        d_embed: int = 8,
        hidden: int = 16,
        num_classes: int = 4,
        *,
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
    ):
        kw = dict(param_dtype=param_dtype, rngs=rngs)
        self.embed = nnx.Embed(vocab_size, d_embed, **kw)
        self.fc = nnx.Linear(d_embed, hidden, **kw)
        self.branch = nnx.Linear(hidden, hidden, **kw)
        self.head = nnx.Linear(hidden, num_classes, **kw)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.fc(self.embed(tokens).mean(axis=1)))
        # A data-dependent choice, as torch's `if`; the branch not taken gets
        # an exactly zero gradient.
        use = jnp.any(tokens[:, 0] == 0)
        h = jnp.where(use, h + jax.nn.relu(self.branch(h)), h)
        return self.head(h)


class CausalSelfAttention(nnx.Module):
    def __init__(self, d_model: int, n_heads: int, *, rngs: nnx.Rngs, param_dtype: Any):
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        kw = dict(param_dtype=param_dtype, rngs=rngs)
        self.query = nnx.Linear(d_model, d_model, **kw)
        # No key bias: it adds q . b to every logit of a row, which softmax
        # cancels, so its true gradient is zero and Adam would amplify rounding
        # noise into full-size steps (Whisper drops it for the same reason).
        self.key = nnx.Linear(d_model, d_model, use_bias=False, **kw)
        self.value = nnx.Linear(d_model, d_model, **kw)
        self.proj = nnx.Linear(d_model, d_model, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.n_heads

        def heads(y: jax.Array) -> jax.Array:
            return y.reshape(b, t, h, d // h).transpose(0, 2, 1, 3)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        att = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(jnp.asarray(d // h, x.dtype))
        causal = jnp.tril(jnp.ones((t, t), bool))
        att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)
        return self.proj((att @ v).transpose(0, 2, 1, 3).reshape(b, t, d))


class FeedForward(nnx.Module):
    def __init__(self, d_model: int, *, rngs: nnx.Rngs, param_dtype: Any):
        self.fc = nnx.Linear(d_model, 4 * d_model, param_dtype=param_dtype, rngs=rngs)
        self.proj = nnx.Linear(4 * d_model, d_model, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(jax.nn.gelu(self.fc(x), approximate=True))


def _layer_norm(d_model: int, *, rngs: nnx.Rngs, param_dtype: Any) -> nnx.LayerNorm:
    # use_fast_variance=False: torch computes mean((x - mean)^2), not E[x^2] - mean^2.
    return nnx.LayerNorm(
        d_model,
        epsilon=LAYER_NORM_EPS,
        use_fast_variance=False,
        param_dtype=param_dtype,
        rngs=rngs,
    )


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, d_model: int, n_heads: int, *, rngs: nnx.Rngs, param_dtype: Any):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.ln1 = _layer_norm(d_model, **kw)
        self.attn = CausalSelfAttention(d_model, n_heads, **kw)
        self.ln2 = _layer_norm(d_model, **kw)
        self.mlp = FeedForward(d_model, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nnx.Module):
    """A one-block GPT: token + position embeddings, a block, final LayerNorm, linear head.

    ``tp``: the block's Megatron plan over :data:`MODEL_AXIS` in its Variables' metadata
    (:func:`with_megatron_plan`), for ``Parallel(model_axes=("model",))``; the parameters
    are the same either way."""

    def __init__(
        self,
        vocab_size: int = 32,
        block_size: int = 8,
        d_model: int = 16,
        n_heads: int = 2,
        *,
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
        tp: bool = False,
    ):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.tok_emb = nnx.Embed(vocab_size, d_model, **kw)
        self.pos_emb = nnx.Embed(block_size, d_model, **kw)
        self.block = Block(d_model, n_heads, **kw)
        self.ln_f = _layer_norm(d_model, **kw)
        self.head = nnx.Linear(d_model, vocab_size, use_bias=False, **kw)
        if tp:  # metadata only: the same parameters, drawn in the same order
            with_megatron_plan(self)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.tok_emb(tokens) + self.pos_emb(jnp.arange(tokens.shape[1]))
        return self.head(self.ln_f(self.block(h)))


def _split(names: tuple[Any, ...] | None) -> dict[str, Any]:
    """A Variable's sharding metadata: ``names`` over the mesh (None: none), read by the
    step, not applied when the Variable is made (no mesh needed)."""
    return {} if names is None else {"out_sharding": names, "eager_sharding": False}


MODEL_AXIS = "model"
"""The mesh axis the reference models' tensor-parallel plans (``tp=True``) name."""


# Megatron's plan of a Block: per Linear, the names of its kernel's and bias's own
# dimensions. Column-split layers split their output features and their biases with them;
# row-split ones split their input features (partial sums, one all-reduce) and keep their
# biases whole. The attention's heads are the outer factor of its output features
# (CausalSelfAttention's reshape to [..., heads, d // heads]), so a column split of
# query, key and value gives each device whole heads, and proj's row split their outputs.
_COLUMN, _ROW = ((None, MODEL_AXIS), (MODEL_AXIS,)), ((MODEL_AXIS, None), (None,))
_BLOCK_PLAN = {
    ("attn", "query"): _COLUMN,
    ("attn", "key"): _COLUMN,
    ("attn", "value"): _COLUMN,
    ("attn", "proj"): _ROW,
    ("mlp", "fc"): _COLUMN,
    ("mlp", "proj"): _ROW,
}


def with_megatron_plan(model: nnx.Module) -> nnx.Module:
    """``model`` with Megatron's plan over :data:`MODEL_AXIS` written into the sharding
    metadata (``out_sharding``) of every :class:`Block` in it, in place: attention's
    ``query``, ``key`` and ``value`` and the MLP's ``fc`` column-split (kernels
    ``(None, "model")``, biases ``("model",)``; each device holds whole heads), attention's
    and the MLP's ``proj`` row-split (kernels ``("model", None)``, biases whole). A stack of
    blocks (:class:`~jaxdp.models.ScannedTransformer`'s) keeps its leading layer axis's
    name. Embeddings, LayerNorms and the head stay whole. Only metadata changes, read by
    the step under ``Parallel(model_axes=("model",))``: the values are the model's own.
    :func:`check_tp` says whether a model axis of a size takes it."""
    for _, node in nnx.iter_graph(model):
        if not isinstance(node, Block):
            continue
        for (part, name), names in _BLOCK_PLAN.items():
            linear = getattr(getattr(node, part), name)
            for variable, own in zip((linear.kernel, linear.bias), names, strict=True):
                if variable is None:  # key has no bias
                    continue
                lead = variable.ndim - len(own)  # a stack's layer axis
                held = variable.get_metadata().get("out_sharding") or (None,) * variable.ndim
                variable.set_metadata(
                    out_sharding=(*tuple(held)[:lead], *own), eager_sharding=False
                )
    return model


def check_tp(model: nnx.Module, tp: int) -> None:
    """Raises ValueError unless a model axis of ``tp`` devices takes ``model``'s
    tensor-parallel plan: ``tp`` must divide every dimension the Variables' metadata split
    over :data:`MODEL_AXIS` (naming the first that it does not) and the heads of every
    :class:`CausalSelfAttention` whose ``query`` is split (each device computes whole
    heads). A model without a plan takes any ``tp``: it is not split."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer (devices of the model axis)")
    for path, node in nnx.iter_graph(model):
        heads = isinstance(node, CausalSelfAttention) and _split_over_model(node.query.kernel)
        if heads and node.n_heads % tp:
            where = ".".join(map(str, path)) or "the model"
            raise ValueError(
                f"tp={tp} must divide the {node.n_heads} attention heads of {where} "
                "(Megatron's plan gives each device whole heads)"
            )
        if isinstance(node, nnx.Variable) and _split_over_model(node):
            names = node.get_metadata()["out_sharding"]
            for size, name in zip(node.shape, names, strict=True):
                if name == MODEL_AXIS and size % tp:
                    raise ValueError(
                        f"tp={tp} must divide {'.'.join(map(str, path))}'s dimension of "
                        f"{size} that its metadata {tuple(names)} splits over {MODEL_AXIS!r}"
                    )


def _split_over_model(variable: nnx.Variable) -> bool:
    return MODEL_AXIS in tuple(variable.get_metadata().get("out_sharding") or ())


class ResidualBlock(nnx.Module):
    """Pre-LayerNorm residual MLP block: ``h + proj(gelu(fc(norm(h))))``, width ``d -> 2d -> d``
    (tanh-approximated GELU, as torch's ``F.gelu(approximate="tanh")``).

    ``tp``: Megatron's plan over :data:`MODEL_AXIS` in the Variables' metadata, torch's
    ``ColwiseParallel`` on ``fc`` (its kernel's and bias's outputs split) and
    ``RowwiseParallel`` on ``proj`` (its kernel's inputs; its bias whole), as
    ``torch_ref``'s ``MEGATRON_PLANS["stack"]``."""

    def __init__(self, d_model: int, *, rngs: nnx.Rngs, param_dtype: Any, tp: bool = False):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        plan = (_COLUMN, _ROW) if tp else ((None,) * 2,) * 2
        (fc_kernel, fc_bias), (proj_kernel, proj_bias) = plan
        self.norm = _layer_norm(d_model, **kw)
        self.fc = nnx.Linear(
            d_model,
            2 * d_model,
            kernel_metadata=_split(fc_kernel),
            bias_metadata=_split(fc_bias),
            **kw,
        )
        self.proj = nnx.Linear(
            2 * d_model,
            d_model,
            kernel_metadata=_split(proj_kernel),
            bias_metadata=_split(proj_bias),
            **kw,
        )

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + self.proj(jax.nn.gelu(self.fc(self.norm(h)), approximate=True))


class Stack(nnx.Module):
    """The sharded-parameter reference: ``[B, 6]`` -> ``embed`` (to width 12) -> 3
    identical :class:`ResidualBlock` s -> ``norm`` -> ``head``: 5 logits.

    ``blocks`` is ONE module made with ``nnx.vmap``: each of its parameters has a
    leading layer axis (``blocks.fc.kernel`` is ``[3, 12, 24]``), the layout of torch's
    ``nn.ModuleList`` ``blocks.0`` ... ``blocks.2`` stacked (``torch_to_params`` converts
    it). The forward loops over it with :func:`jaxdp.scan_layers`, so at ZeRO stage 3 the
    blocks are gathered one at a time. ``head`` has 5 rows, which 2 or 4 devices do not
    divide. ``tp``: each block's Megatron plan over :data:`MODEL_AXIS`
    (:class:`ResidualBlock`), for ``Parallel(model_axes=("model",))``.
    """

    def __init__(
        self,
        d_in: int = 6,
        d_model: int = 12,
        n_blocks: int = 3,
        num_classes: int = 5,
        *,
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
        tp: bool = False,
    ):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.embed = nnx.Linear(d_in, d_model, **kw)

        @nnx.split_rngs(splits=n_blocks)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs: nnx.Rngs) -> ResidualBlock:
            return ResidualBlock(d_model, rngs=rngs, param_dtype=param_dtype, tp=tp)

        self.blocks = name_layer_axis(blocks(rngs))  # a stack of layers (metadata)
        self.norm = _layer_norm(d_model, **kw)
        self.head = nnx.Linear(d_model, num_classes, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = scan_layers(lambda block, h: block(h), self.blocks, self.embed(x))
        return self.head(self.norm(h))


def _sum_loss(model: nnx.Module, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    return model(batch[0]).sum()


def _cross_entropy(model: nnx.Module, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


MODELS: dict[str, tuple[Callable[..., nnx.Module], Callable[..., jax.Array]]] = {
    "linear": (LinearModel, _sum_loss),
    "mlp": (MLP, _cross_entropy),
    "cnn": (CNN, _cross_entropy),
    "transformer": (Transformer, _cross_entropy),
    "cnn_bn": (CNNBN, _cross_entropy),
    "embed_branch": (EmbedBranch, _cross_entropy),
    "stack": (Stack, _cross_entropy),
}
"""``name -> (model class, loss(module, (x, y)))`` of every reference model."""

TRAINABLE: dict[str, Callable[[tuple[str, ...], Any], bool]] = {
    "embed_branch": lambda path, value: path[0] != "embed",
}
"""``make_train_step(trainable=...)`` of the reference models that freeze parameters (as
torch_ref sets ``requires_grad=False``): a predicate on the parameter's path; absent, all train."""


TENSOR_PARALLEL = ("stack", "transformer")
"""The reference models with a tensor-parallel plan (``build_model(..., tp=True)``)."""


def build_model(
    name: str, *, seed: int = 0, param_dtype: Any = jnp.float32, tp: bool = False
) -> nnx.Module:
    """The reference model ``name`` (one of ``MODELS``) with its default sizes; ``tp``:
    with its tensor-parallel plan over :data:`MODEL_AXIS` in its metadata (the models of
    :data:`TENSOR_PARALLEL`)."""
    cls, _ = _lookup(name)
    if tp and name not in TENSOR_PARALLEL:
        raise ValueError(
            f"tp=True: model {name!r} has no tensor-parallel plan; the models with one: "
            f"{TENSOR_PARALLEL}"
        )
    if cls is LinearModel:
        return LinearModel(param_dtype=param_dtype)
    if tp:
        return cls(rngs=nnx.Rngs(seed), param_dtype=param_dtype, tp=True)
    return cls(rngs=nnx.Rngs(seed), param_dtype=param_dtype)


def model_loss(name: str) -> Callable[..., jax.Array]:
    """``loss(module, (x, y))`` of reference model ``name``: a micro-batch mean (linear: sum)."""
    return _lookup(name)[1]


def _lookup(name: str) -> tuple[Callable[..., nnx.Module], Callable[..., jax.Array]]:
    if name not in MODELS:
        raise ValueError(f"model={name!r} must be one of {sorted(MODELS)}")
    return MODELS[name]

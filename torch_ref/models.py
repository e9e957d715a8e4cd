"""The reference models, their losses and their synthetic data sets.

Attribute names are the parameter layout shared with jaxdp's Flax NNX models:
the state_dict key ``a.b.weight`` is the NNX parameter path ``a.b.kernel`` (or
``scale``/``embedding``), see ``_notes/models.md``. Only ``cnn_bn`` registers
buffers (BatchNorm's ``running_mean``, ``running_var``, ``num_batches_tracked``,
the names jaxdp's ``BatchNorm`` uses); ``embed_branch`` has a frozen embedding
(``requires_grad=False``) and a branch only some micro-batches use; ``stack`` holds
its repeated layers in an ``nn.ModuleList`` (the blocks FSDP2 shards one by one) and
has a 5-class head, whose 5 rows 2 or 4 devices do not divide.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

MODELS = ("linear", "mlp", "cnn", "transformer", "cnn_bn", "embed_branch", "stack")
"""The reference model names, as ``build_model``, ``compute_loss`` and ``make_data`` take them."""

DTypeLike = str | np.dtype | torch.dtype

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class LinearModel(nn.Module):
    """The seed's model: ``Linear(8, 1, bias=False)``; its loss is the SUM of the outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class MLP(nn.Module):
    """``16 -> 32 -> 32 -> 4`` with ReLU; logits for 4 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool between them, a global mean, 10 logits.

    Takes NHWC images ``[B, 8, 8, 1]`` (the shared data layout) and permutes them
    to torch's NCHW.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.permute(0, 3, 1, 2)
        h = F.max_pool2d(F.relu(self.conv1(h)), kernel_size=2, stride=2)
        h = F.relu(self.conv2(h)).mean(dim=(2, 3))
        return self.head(h)


class CNNBN(nn.Module):
    """``CNN`` with ``BatchNorm2d`` after each convolution (the convolutions without bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.permute(0, 3, 1, 2)
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(h))), kernel_size=2, stride=2)
        h = F.relu(self.bn2(self.conv2(h))).mean(dim=(2, 3))
        return self.head(h)


class CPUSyncBatchNorm(nn.BatchNorm2d):
    """``nn.SyncBatchNorm``'s statistics with plain differentiable collectives.

    ``nn.SyncBatchNorm`` runs only on GPUs (its kernels are CUDA's). In training
    under an initialized process group this normalizes with the mean and biased
    variance over every rank's batch (sums all-reduced with
    ``torch.distributed.nn.functional.all_reduce``, whose backward all-reduces
    the gradients, as SyncBatchNorm's backward does) and updates the running
    variance with the unbiased variance over the global count, as
    SyncBatchNorm does.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(x)
        from torch.distributed.nn.functional import all_reduce

        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, -1] + [1] * (x.dim() - 2)
        n = x.numel() // x.size(1) * dist.get_world_size()
        mean = all_reduce(x.sum(dims)) / n
        var = all_reduce((x - mean.view(shape)).square().sum(dims)) / n
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * n / (n - 1))
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return y * self.weight.view(shape) + self.bias.view(shape)


def convert_sync_batchnorm(module: nn.Module, device: str) -> nn.Module:
    """``nn.SyncBatchNorm.convert_sync_batchnorm`` on CUDA; on CPU every ``BatchNorm2d``
    becomes a ``CPUSyncBatchNorm`` with the same parameters and buffers."""
    if device == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    for name, child in module.named_children():
        if type(child) is nn.BatchNorm2d:
            sync = CPUSyncBatchNorm(child.num_features, child.eps, child.momentum)
            sync.to(child.weight.dtype)
            sync.load_state_dict(child.state_dict())
            setattr(module, name, sync)
        else:
            convert_sync_batchnorm(child, device)
    return module


class EmbedBranch(nn.Module):
    """Tokens ``[B, 6]`` -> frozen embedding (mean over tokens) -> ``fc`` (ReLU) ->
    ``h + relu(branch(h))`` only for a micro-batch holding a row that starts with
    token 0 -> ``head``: 4 logits. ``branch`` goes unused in the other micro-batches."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.embed.weight.requires_grad_(False)
        self.fc = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc(self.embed(x).mean(dim=1)))
        if bool((x[:, 0] == 0).any()):
            h = h + F.relu(self.branch(h))
        return self.head(h)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written out (no fused kernel), as nanoGPT's;
    query, value and output projections with bias, the key projection without."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.query = nn.Linear(d_model, d_model)
        # No key bias: it adds q.b to every logit of a row, which softmax cancels, so its
        # true gradient is 0 and Adam would step on rounding noise (docs/decisions.md).
        self.key = nn.Linear(d_model, d_model, bias=False)
        self.value = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        head_dim = d // self.n_heads

        def heads(h: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, H, T, hd]
            return h.view(b, t, self.n_heads, head_dim).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        att = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
        future = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        att = att.masked_fill(future, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class FeedForward(nn.Module):
    """``Linear(d, 4d)``, tanh-approximated GELU, ``Linear(4d, d)``."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``h + attn(ln1(h))``, then ``h + mlp(ln2(h))``."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=1e-5)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model, eps=1e-5)
        self.mlp = FeedForward(d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class Transformer(nn.Module):
    """A one-block GPT: tokens ``[B, 8]`` in ``[0, 32)`` -> next-token logits ``[B, 8, 32]``."""

    def __init__(
        self, *, vocab_size: int = 32, block_size: int = 8, d_model: int = 16, n_heads: int = 2
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.block = Block(d_model, n_heads)
        self.ln_f = nn.LayerNorm(d_model, eps=1e-5)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        h = self.tok_emb(x) + self.pos_emb(positions)
        return self.head(self.ln_f(self.block(h)))


class ResidualBlock(nn.Module):
    """Pre-LayerNorm residual MLP block: ``h + proj(gelu(fc(norm(h))))``, width ``d -> 2d -> d``."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=1e-5)
        self.fc = nn.Linear(d_model, 2 * d_model)
        self.proj = nn.Linear(2 * d_model, d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(F.gelu(self.fc(self.norm(h)), approximate="tanh"))


class Stack(nn.Module):
    """The sharded-parameter reference: ``[B, 6]`` -> ``embed`` (to width 12) -> 3
    identical ``ResidualBlock`` s in ``blocks`` (an ``nn.ModuleList``) -> ``norm`` ->
    ``head``: 5 logits. ``head``'s weight ``[5, 12]`` and bias ``[5]`` split unevenly
    along dimension 0 over 2 or 4 devices (FSDP2 pads them); the bias has no
    dimension 2 or 4 divides."""

    def __init__(self, *, d_in: int = 6, d_model: int = 12, n_blocks: int = 3, classes: int = 5):
        super().__init__()
        self.embed = nn.Linear(d_in, d_model)
        self.blocks = nn.ModuleList(ResidualBlock(d_model) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d_model, eps=1e-5)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


_CLASSES: dict[str, type[nn.Module]] = {
    "linear": LinearModel,
    "mlp": MLP,
    "cnn": CNN,
    "transformer": Transformer,
    "cnn_bn": CNNBN,
    "embed_branch": EmbedBranch,
    "stack": Stack,
}


def check_model_name(name: str) -> None:
    """Raises ``ValueError`` unless ``name`` is one of ``MODELS``."""
    if name not in MODELS:
        raise ValueError(f"model={name!r} is not a reference model; choose one of {MODELS}")


def torch_dtype(dtype: DTypeLike) -> torch.dtype:
    """``"float32"``/``"float64"`` (or the numpy/torch dtype) as a torch floating dtype."""
    if isinstance(dtype, torch.dtype):
        key = str(dtype).removeprefix("torch.")
    else:
        try:
            key = np.dtype(dtype).name
        except TypeError:
            key = repr(dtype)
    if key not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {tuple(_DTYPES)}")
    return _DTYPES[key]


def build_model(name: str, *, seed: int = 0, dtype: DTypeLike = torch.float64) -> nn.Module:
    """A fresh reference model: ``torch.manual_seed(seed)``, construct, cast to ``dtype``.

    Parameters get PyTorch's default initialization, drawn in float32 and then
    cast, so the float32 and float64 models of one seed start from the same
    values; the linear model's weight is all ones (the seed's).
    """
    check_model_name(name)
    torch.manual_seed(seed)
    model = _CLASSES[name]()
    if name == "linear":
        nn.init.ones_(model.linear.weight)
    return model.to(torch_dtype(dtype))


def numpy_state_dict(model: nn.Module) -> dict[str, np.ndarray]:
    """``model.state_dict()`` as numpy arrays (copies, on the host)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def compute_loss(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of ONE micro-batch, a scalar.

    linear: ``model(x).sum()`` (the seed's SUM; ``y`` is unused). The others:
    cross-entropy, mean over the micro-batch (transformer: over all ``B * T``
    positions).
    """
    check_model_name(name)
    out = model(x)
    if name == "linear":
        return out.sum()
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def make_data(
    name: str, num_samples: int, *, seed: int = 0, dtype: DTypeLike = "float64"
) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic synthetic data set ``(x, y)`` for model ``name``, made with numpy.

    linear: x uniform in [0, 1) ``[n, 8]``, y zeros ``[n, 1]`` (float, unused).
    mlp: x normal ``[n, 16]``, y int64 in [0, 4), the argmax of a fixed random
    linear teacher. cnn, cnn_bn: x normal NHWC ``[n, 8, 8, 1]``, y int64 in
    [0, 10) from a linear teacher on the flattened image. embed_branch: int64
    tokens ``[n, 6]`` in [1, 16), y in [0, 4) from a linear teacher on the token
    counts; in row blocks of 16 (a global batch of 16 read in order), every row
    of blocks 0, 3, 6, ... starts with token 0, only the block's row 1 in
    blocks 1, 4, ..., and none in blocks 2, 5, ... transformer: int64 token
    sequences ``[n, 9]`` in [0, 32) that step by +1 or +2 (mod 32) from a
    random start; x is the first 8 tokens, y the next-token targets. stack: x
    normal ``[n, 6]``, y int64 in [0, 5) from a linear teacher. Floating arrays
    are in ``dtype``; the same ``seed`` gives the same arrays.
    """
    check_model_name(name)
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be at least 1")
    np_dtype = np.dtype(str(torch_dtype(dtype)).removeprefix("torch."))
    rng = np.random.default_rng(seed)
    if name == "linear":
        x = rng.random((num_samples, 8))
        return x.astype(np_dtype), np.zeros((num_samples, 1), np_dtype)
    if name == "transformer":
        start = rng.integers(0, 32, size=(num_samples, 1))
        steps = rng.integers(1, 3, size=(num_samples, 8))
        tokens = (np.concatenate([start, start + np.cumsum(steps, axis=1)], axis=1) % 32).astype(
            np.int64
        )
        return tokens[:, :-1].copy(), tokens[:, 1:].copy()
    if name == "embed_branch":
        tokens = rng.integers(1, 16, size=(num_samples, 6))
        block = np.arange(num_samples) // 16
        tokens[block % 3 == 0, 0] = 0  # every micro-batch of these 16 rows uses the branch
        tokens[(block % 3 == 1) & (np.arange(num_samples) % 16 == 1), 0] = 0  # one row of 16
        counts = np.stack([np.bincount(row, minlength=16) for row in tokens])
        y = np.argmax(counts @ rng.normal(size=(16, 4)), axis=1).astype(np.int64)
        return tokens.astype(np.int64), y
    shape, classes = {"mlp": ((16,), 4), "stack": ((6,), 5)}.get(name, ((8, 8, 1), 10))
    x = rng.normal(size=(num_samples, *shape))
    teacher = rng.normal(size=(math.prod(shape), classes))
    y = np.argmax(x.reshape(num_samples, -1) @ teacher, axis=1).astype(np.int64)
    return x.astype(np_dtype), y


def seed_data() -> tuple[np.ndarray, np.ndarray]:
    """The seed's data: ``torch.manual_seed(0); torch.rand(8, 8)`` (float32 draws) as
    float64, and y zeros ``[8, 1]``. Sets torch's global seed, as the seed did."""
    torch.manual_seed(0)
    x = torch.rand(8, 8).numpy().astype(np.float64)
    return x, np.zeros((8, 1), np.float64)

"""Whether ``jaxdp train``'s model can be held at all, asked before it is built.

``jaxdp train --hidden 3000000`` (9e12 parameters, 36 TB of float32 weights alone)
ended in an unhandled traceback after 56 s. The model's shapes are traced without
allocating anything (``nnx.eval_shape``), and what its training state needs at least
(weights, one micro-batch's gradients, the optimizer's moments, the gradient
accumulator; activations and XLA's buffers come on top) is held against the memory
there is: on CPU, this machine's (or its cgroup's) memory, shared by every emulated
device of the process; elsewhere, each device's own (JAX's ``bytes_limit``). A state
larger than that cannot fit however the run goes, so it is a usage error. Anything
smaller is left to run: the bound is the memory there is, not what is free now,
so that a busy machine never refuses a run that would fit.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import Mesh

from .._mesh import DATA_AXIS
from .._shards import resting_size
from .._stages import stage_layout
from ._config import TrainConfig
from ._data import Split
from ._metrics import agree


def check_fits(
    config: TrainConfig, data: Split, mesh: Mesh, build: Callable[[], nnx.Module]
) -> None:
    """Raises ValueError, naming the flag, the size and the bytes, if the training state of
    the model ``build()`` makes (``config``'s, on ``data``) cannot fit in the memory there
    is; ``build`` is only traced. On every process (one collective: they stop together)."""
    model = nnx.eval_shape(build)
    shapes = [x.shape for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    params = sum(math.prod(s) for s in shapes)
    # HSDP splits over a shard group only; every group holds the same copy. ZeRO splits
    # over the data ranks; a model axis (--tp) at most divides what they hold by its size.
    n = config.shards or mesh.shape[DATA_AXIS]
    layout = stage_layout(config.zero_stage)
    # Stage 3 holds a leaf no dimension of which the devices divide padded to a multiple.
    padded = resting_size(shapes, n, layout)
    need, parts = state_bytes(config, params, n, padded if layout.params_split else None)
    if config.tp > 1:  # at least: the embeddings, norms and head stay whole
        need, parts = math.ceil(need / config.tp), f"{parts}, over tp={config.tp} at most"
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    failure = None
    platform = local[0].platform if local else "cpu"
    if platform == "cpu":
        have, where = machine_memory(), "this machine has"
        total = need * len(local)
        held = f"{_size(need)} per device, {_size(total)} for this process's "
        held += f"{len(local)} CPU device(s)"
    else:
        have, where = _device_memory(local[0]), f"each {platform} device has"
        total, held = need, f"{_size(need)} per device"
    if have is not None and total > have:
        what = _model(config, data)
        failure = ValueError(
            f"{what}: {params:,} parameters, whose training state needs at least {held} "
            f"({parts}), and {where} {_size(have)}: {_fix(config)}"
        )
    if agree(failure is not None):
        raise failure or ValueError("another process cannot hold the model (its error says why)")


def state_bytes(
    config: TrainConfig, params: int, num_devices: int, padded: int | None = None
) -> tuple[int, str]:
    """Bytes of one device's training state at least, and what they are made of, with the
    split parts split over ``num_devices`` (the shard group's, under HSDP); ``padded``:
    stage 3's parameter count with its padded leaves padded (None: ``params``), which the
    split parts count."""
    each = 8 if config.precision == "float64" else 4  # bfloat16 keeps float32 parameters
    moments = 2 if config.optimizer == "adamw" else 1  # SGD keeps its momentum
    # ZeRO stage 1 splits the moments over the devices, stage 2 the accumulator too,
    # stage 3 the weights and gradients too (its gathered layer is a temporary).
    layout = stage_layout(config.zero_stage)
    per = [
        ("weights", each, layout.params_split),
        ("gradients", each, layout.params_split),
        (
            "AdamW's 2 moments" if moments == 2 else "SGD's momentum",
            moments * each,
            layout.state_split,
        ),
        ("the accumulator", each, layout.window_split),
    ]
    share = [b / (num_devices if split else 1) for _, b, split in per]
    need = params * sum(share)
    held = params if padded is None else padded
    if held != params:  # the split parts of the padded count, the rest of the model's
        need = sum(b * (held / num_devices if split else params) for _, b, split in per)
    described = " + ".join(
        f"{what} {b:g}" + (f"/{num_devices}" if split else "") for what, b, split in per
    )
    if held != params:
        described += f", the split parts of {held:,} parameters padded"
    return math.ceil(need), f"{described} bytes per parameter"


def machine_memory() -> int | None:
    """This machine's memory in bytes, or its cgroup's limit where lower; None if unknown."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    try:
        limit = pathlib.Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        limit = "max"
    return min(total, int(limit)) if limit.isdigit() else total


def _device_memory(device: jax.Device) -> int | None:
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend without memory statistics
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def _model(config: TrainConfig, data: Split) -> str:
    """The flag that sized the model, and the model: ``hidden=3000000: the MLP 64-...-10``."""
    if config.model == "mlp":
        sizes = [data.x_train.shape[-1], config.hidden, config.hidden, data.num_classes]
        return f"hidden={config.hidden}: the MLP {'-'.join(map(str, sizes))}"
    if config.model == "gpt":
        return f"hidden={config.hidden}: the GPT of d_model {config.hidden}"
    source = f"data={config.data!r}" if config.data else "model='cnn'"
    return f"{source}: the CNN on {data.x_train.shape[1:]} images"


def _fix(config: TrainConfig) -> str:
    flag = "--data" if config.model == "cnn" else "--hidden"
    return f"choose a smaller {flag} (or fewer devices per process, on CPU)"


def _size(n: float) -> str:
    """``144.0 TB (1.44e+14 bytes)``: decimal units, as ``jaxdp plan``'s."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n:.3g} bytes)"
    return f"{n:.0f} bytes"

"""The main job: data-parallel training of an MLP on the digits images."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from ._data import load_digits
from ._layout import batch_sizes, epoch_batches, micro_batches
from ._mesh import data_mesh
from ._step import AccumulationPath, Strategy, make_train_step


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    num_devices: int | None = None  # data-parallel devices; None: all there are
    accum_steps: int = 2  # micro-batches per device per optimizer step
    micro_batch_size: int = 16  # rows per micro-batch per device
    epochs: int = 15  # passes over the training rows
    optimizer: str = "adamw"  # "adamw" or "sgd" (momentum 0.9)
    learning_rate: float = 3e-3
    path: AccumulationPath = "fused"  # "fused" or "multisteps"
    strategy: Strategy = "shard_map"  # "shard_map" or "pmap"
    hidden: int = 128  # width of the MLP's hidden layer
    seed: int = 0  # model init, data order
    metrics_out: str | None = None  # JSON lines file, one record per optimizer step
    progress: bool | None = None  # progress bar; None: only on a terminal


class MLP(nnx.Module):
    """64 pixels -> hidden (ReLU) -> 10 digit logits."""

    def __init__(self, hidden: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.relu(self.hidden(x)))


def cross_entropy(model: MLP, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def _optimizer(config: TrainConfig) -> optax.GradientTransformation:
    if config.optimizer == "adamw":
        return optax.inject_hyperparams(optax.adamw)(learning_rate=config.learning_rate)
    if config.optimizer == "sgd":
        return optax.inject_hyperparams(optax.sgd)(learning_rate=config.learning_rate, momentum=0.9)
    raise ValueError(f"optimizer={config.optimizer!r} must be 'adamw' or 'sgd'")


def train(config: TrainConfig) -> dict[str, Any]:
    """Trains, evaluates on the held-out rows and returns a summary."""
    data = load_digits(seed=config.seed)
    mesh = data_mesh(config.num_devices)
    sizes = batch_sizes(
        num_devices=mesh.devices.size,
        accum_steps=config.accum_steps,
        micro_batch_size=config.micro_batch_size,
    )
    step = make_train_step(
        cross_entropy,
        _optimizer(config),
        mesh=mesh,
        accum_steps=sizes.accum_steps,
        path=config.path,
        strategy=config.strategy,
    )
    platform = mesh.devices.flat[0].platform
    print(
        f"jaxdp train: digits MLP on {sizes.num_devices} {platform} device(s), "
        f"{len(data.x_train)} train / {len(data.x_test)} held-out images"
    )
    print(f"batch: {sizes.describe()}")
    state = step.init(MLP(config.hidden, rngs=nnx.Rngs(config.seed)))
    steps_per_epoch = len(epoch_batches(len(data.x_train), sizes, seed=config.seed))
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(config.metrics_out, "w")) if config.metrics_out else None
        bar = stack.enter_context(
            tqdm(
                total=config.epochs * steps_per_epoch,
                unit="step",
                disable=None if config.progress is None else not config.progress,
            )
        )
        for epoch in range(config.epochs):
            for rows in epoch_batches(len(data.x_train), sizes, epoch=epoch, seed=config.seed):
                batch = (data.x_train[rows], data.y_train[rows])
                for call in [batch] if config.path == "fused" else micro_batches(batch, sizes):
                    state, metrics = step(state, call)
                record = _record(state, metrics, epoch, sizes.global_batch_size, start)
                if sink:
                    sink.write(json.dumps(record) + "\n")
                bar.set_postfix(
                    loss=f"{record['loss']:.4f}", samples_s=f"{record['samples_per_s']:.0f}"
                )
                bar.update()
            if bar.disable:
                print(
                    f"epoch {epoch + 1}/{config.epochs}: step {record['step']} "
                    f"loss {record['loss']:.4f}"
                )
    accuracy = evaluate(step.model(state), data.x_test, data.y_test)
    summary = {
        "steps": int(state.step),
        "final_loss": record["loss"],
        "test_accuracy": accuracy,
        "seconds": time.perf_counter() - start,
    }
    print(
        f"held-out accuracy: {accuracy:.2%} after {summary['steps']} optimizer steps "
        f"({summary['seconds']:.1f} s)"
    )
    return summary


def _record(
    state: Any, metrics: dict[str, Any], epoch: int, global_batch: int, start: float
) -> dict[str, Any]:
    step = int(state.step)
    samples = step * global_batch
    return {
        "step": step,
        "epoch": epoch,
        "samples": samples,
        "samples_per_s": samples / (time.perf_counter() - start),
        **{k: float(v) for k, v in metrics.items() if k != "emitted"},
    }


def evaluate(model: MLP, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of ``model`` on ``x``."""
    logits = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(x))
    return float(np.mean(np.argmax(np.asarray(logits), -1) == y))

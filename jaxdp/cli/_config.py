"""The configuration of ``jaxdp train`` and what a resumed run must keep.

Nothing here needs the ``cli`` extra, nor JAX: the command line builds its parser
(and its help, with these defaults) before it checks that the extra is installed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # only names of string choices: the parser and its help import no JAX
    from .._options import AccumulationPath, Strategy

Precision = Literal["float32", "float64", "bfloat16"]
DEFAULT_EPOCHS = 15  # when neither epochs nor steps is given
GPT_HEADS, GPT_LAYERS = 4, 4  # the sizes of --model gpt that --hidden (d_model) leaves fixed


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # "mlp" (64-hidden-hidden-10), "cnn" (on the 8x8x1 images) or "gpt" (the scanned
    # GPT on the 64 pixels as tokens); None: "gpt" at zero_stage 3, else "mlp".
    model: str | None = None
    data: str | None = None  # a .npz with x (features or images) and y (labels); None: digits
    num_classes: int | None = None  # the model's outputs with data; None: the largest label + 1
    num_devices: int | None = None  # data-parallel devices; None: all there are
    # CPU devices each process emulates, set before JAX starts (the command line's
    # --cpu-devices; None: $JAXDP_CPU_DEVICES, else 4); saved, so a resume gets it back.
    cpu_devices: int | None = None
    accum_steps: int = 2  # micro-batches per device per optimizer step
    micro_batch_size: int = 16  # rows per micro-batch per device
    epochs: int | None = None  # last epoch (exclusive); None: 15, or no limit with steps
    steps: int | None = None  # stop after this many optimizer steps in all; None: no limit
    optimizer: str = "adamw"  # "adamw" or "sgd" (momentum 0.9)
    learning_rate: float = 3e-3
    path: AccumulationPath = "fused"  # "fused" or "multisteps"
    strategy: Strategy = "shard_map"  # "shard_map" or "pmap"
    # 1: optimizer state sharded over the devices; 2: and the accumulator; 3: and the
    # parameters and gradients (the GPT's blocks gathered one at a time)
    zero_stage: int = 0
    # HSDP at zero_stage 3: devices per shard group, the parameters split over each group
    # and the groups' gradients all-reduced once per step; None: one group of every device
    shards: int | None = None
    # Tensor parallelism: devices of a model axis per data rank, over which the GPT is split
    # by Megatron's plan (whole attention heads, MLP columns, their projections' rows); the
    # mesh is num_devices data ranks x tp devices. 1: none
    tp: int = 1
    comm_dtype: str | None = None  # "bfloat16": gradients sent in bfloat16; None: as accumulated
    precision: Precision = "float32"  # bfloat16: bfloat16 compute, float32 parameters
    hidden: int = 128  # width of the MLP's hidden layers, or the GPT's d_model
    seed: int = 0  # model init, held-out split, data order
    checkpoint_dir: str | None = None  # where checkpoints go; None: none
    checkpoint_every: int | None = None  # optimizer steps between checkpoints; None: at the end
    keep: int = 3  # checkpoints kept (the newest verified ones)
    skip_nonfinite: bool = True  # skip an update with NaN/Inf gradients; off: stop at it
    resume: bool = False  # continue from the newest readable checkpoint in checkpoint_dir
    force_resume: bool = False  # resume even with another global_batch_size
    metrics_out: str | None = None  # JSON lines file, one record per optimizer step
    plot: str | None = None  # PNG of loss, held-out accuracy and learning rate
    tensorboard: str | None = None  # a TensorBoard log directory for the metrics
    progress: bool | None = None  # progress bar; None: only on a terminal

    def __post_init__(self) -> None:
        # Every number, before JAX starts: a bad one must not cost a run (or a NaN step 1).
        for name in _POSITIVE:
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise ValueError(
                f"seed={self.seed!r} must be an integer in [0, 2**32) (numpy's and "
                "scikit-learn's seeds; JAX's key would drop higher bits)"
            )
        lr = self.learning_rate
        number = isinstance(lr, int | float) and not isinstance(lr, bool)
        if not number or not math.isfinite(lr) or lr < 0:
            raise ValueError(
                f"learning_rate={lr!r} must be a finite number >= 0 (as torch.optim requires; "
                "a negative one ascends the loss)"
            )
        if self.model is None:  # stage 3 and --tp train the model whose layers they split
            split = self.zero_stage == 3 or self.tp > 1
            object.__setattr__(self, "model", "gpt" if split else "mlp")
        for name, allowed in (
            ("model", ("mlp", "cnn", "gpt")),
            ("optimizer", ("adamw", "sgd")),
            ("precision", ("float32", "float64", "bfloat16")),
            ("zero_stage", (0, 1, 2, 3)),
            ("comm_dtype", (None, "bfloat16")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        self._check_shards()
        self._check_tp()
        for name in ("resume", "checkpoint_every"):
            if getattr(self, name) and self.checkpoint_dir is None:
                raise ValueError(f"{name}={getattr(self, name)!r} needs a checkpoint_dir")
        if self.num_classes is not None and self.data is None:
            raise ValueError(
                f"num_classes={self.num_classes} needs data (the digits have 10 classes)"
            )
        if self.model == "gpt":
            if self.data is not None:
                raise ValueError(
                    f"data={self.data!r}: model='gpt' trains on the digits only (their 64 "
                    "pixels as tokens); choose model='mlp' or 'cnn' for data of your own"
                )
            if self.hidden % GPT_HEADS:
                raise ValueError(
                    f"hidden={self.hidden} is the GPT's d_model and must be divisible by its "
                    f"{GPT_HEADS} attention heads"
                )
        if self.plot is not None and not self.plot.endswith(".png"):
            raise ValueError(f"plot={self.plot!r} must name a .png file")

    def _check_shards(self) -> None:
        shards = self.shards
        if shards is None:
            return
        if not _is_int(shards) or shards < 2:
            raise ValueError(
                f"shards={shards!r} must be an integer of at least 2 (devices per shard "
                "group); one device per group keeps a whole copy on every device: that is "
                "zero_stage=0 (DDP)"
            )
        # A resume takes zero_stage from its checkpoint (the rule is checked again then,
        # by the library); this config of the given flags alone may not have it yet.
        if self.zero_stage != 3 and not self.resume:
            raise ValueError(
                f"shards={shards} needs zero_stage=3 (--shards needs --zero-stage 3: HSDP "
                f"splits the parameters over each shard group), got zero_stage="
                f"{self.zero_stage}: stages 0 to 2 keep every parameter whole on every device"
            )
        if self.num_devices is not None and self.num_devices % shards:
            raise ValueError(
                f"shards={shards} must divide num_devices={self.num_devices} (the devices "
                "form num_devices // shards replica groups of shards devices each)"
            )

    def _check_tp(self) -> None:
        tp = self.tp
        if tp == 1:
            return
        if self.model != "gpt":
            raise ValueError(
                f"tp={tp} needs model='gpt' (--tp needs --model gpt, the model with a "
                f"tensor-parallel plan: Megatron's, over its attention heads and MLP); "
                f"model={self.model!r} has none"
            )
        if GPT_HEADS % tp:
            raise ValueError(
                f"tp={tp} must divide the GPT's {GPT_HEADS} attention heads (Megatron's plan "
                "gives each device of the model axis whole heads)"
            )
        if self.shards is not None:
            raise ValueError(
                f"tp={tp} with shards={self.shards}: jaxdp train's HSDP takes no model axis "
                "yet; leave out --shards (--zero-stage 0 to 3 split over the data ranks)"
            )
        if self.strategy != "shard_map":
            raise ValueError(
                f"tp={tp} needs strategy='shard_map' (the model axis is XLA's partitioner's), "
                f"got strategy={self.strategy!r}"
            )

    @property
    def last_epoch(self) -> int | None:
        if self.epochs is None and self.steps is None:
            return DEFAULT_EPOCHS
        return self.epochs


_POSITIVE = (
    "num_classes",
    "num_devices",
    "cpu_devices",
    "accum_steps",
    "micro_batch_size",
    "epochs",
    "steps",
    "checkpoint_every",
    "keep",
    "hidden",
    "tp",
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Fields a resumed run must share with the checkpoint's, and why. The data are checked
# by content, not by path (the loader's fingerprint): the same data at another path resume.
RESUME_FIXED = {
    "model": "the parameters would not fit",
    "hidden": "the parameters would not fit",
    "num_classes": "the parameters would not fit",
    "precision": "the parameter and compute dtypes would change",
    "optimizer": "the optimizer state would not fit",
    "learning_rate": "the optimizer state holds the learning rate",
    "path": "the accumulation path decides the optimizer state's layout",
    "zero_stage": "the stage decides how the optimizer state is split over the devices",
    "shards": "the shard groups decide how the parameters and optimizer state are split",
    "seed": "the seed fixes the held-out split and every epoch's data order",
}

# Fields a resume never takes from the checkpoint: they say how to resume.
NOT_RESUMED = frozenset({"checkpoint_dir", "resume", "force_resume", "progress"})

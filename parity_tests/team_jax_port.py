"""The JAX port of team_ddp_script.py, as the team writes it: the model in Flax NNX, its
warm-up schedule, and its own optax optimizer for the two parameter groups."""

import jax
import jax.numpy as jnp
import optax
import team_ddp_script as team
from flax import nnx

from jaxdp.parity import clip_grad_norm_like_torch


class JaxNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.fc1 = nnx.Linear(6, 8, rngs=rngs, param_dtype=param_dtype)
        self.norm = nnx.LayerNorm(8, epsilon=1e-5, rngs=rngs, param_dtype=param_dtype)  # torch's
        self.fc2 = nnx.Linear(8, 3, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.norm(self.fc1(x))))


def schedule(count):
    """LambdaLR's warm-up: the first group's rate of the update after ``count`` updates."""
    return team.LR * jnp.minimum(1.0, (jnp.asarray(count, jnp.float64) + 1) / team.WARMUP)


def _group(path, _):
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return "decay" if names[0] in ("fc1", "fc2") and "kernel" in names else "rest"


def team_optimizer(rest_weight_decay=0.0):
    """The clip, then AdamW per group: decay on the kernels, twice the rate elsewhere."""
    return optax.chain(
        clip_grad_norm_like_torch(team.MAX_GRAD_NORM),
        optax.multi_transform(
            {
                "decay": optax.adamw(schedule, eps_root=0.0, weight_decay=team.WEIGHT_DECAY),
                "rest": optax.adamw(
                    lambda count: 2 * schedule(count), eps_root=0.0, weight_decay=rest_weight_decay
                ),
            },
            lambda params: jax.tree_util.tree_map_with_path(_group, params),
        ),
    )

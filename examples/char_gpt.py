"""A small character-level GPT, trained data-parallel on Python's own reference manual.

The corpus is ``pydoc_data.topics``: the language reference pages that
``help()`` shows, shipped with Python itself (about 465,000 characters; no
download). The model is jaxdp's reference transformer (token and position
embeddings, one pre-LayerNorm block of causal self-attention and a GELU MLP, a
linear head) at 64 characters of context, width 128 and 4 heads. Each
optimizer step takes 128 windows of 64 characters: 4 emulated CPU devices x 2
micro-batches x 16 windows, one all-reduce per step. It prints the held-out
loss, then samples text.

Run::

    python examples/char_gpt.py            # 300 steps, about a minute on 2 cores
    python examples/char_gpt.py --quick    # 16 steps, for CI

Expected output (the numbers and the sample vary a little with the CPU)::

    corpus: 464,970 characters, 103 distinct (pydoc_data.topics)
    batch: global_batch_size=128 = num_devices=4 x accum_steps=2 x micro_batch_size=16
    held-out loss before training: 5.34 (uniform over 103 characters: 4.63)
    step   75/300: loss 2.52
    step  150/300: loss 2.05
    step  225/300: loss 1.85
    step  300/300: loss 1.60
    held-out loss after 300 steps: 1.82
    sample: The avior mattring type oary the class seentariby and a gis the ...

With ``--quick`` the held-out loss ends below 3.3 (2.96 here). Its memory plan:
``jaxdp plan --model transformer --model-arg vocab_size=103 --model-arg block_size=64
--model-arg d_model=128 --model-arg n_heads=4 --num-devices 4 --global-batch-size 128
--device-memory 80GB``.
"""

import argparse
import math
import pydoc_data.topics

import jax
import numpy as np
import optax
from flax import nnx

import jaxdp

BLOCK_SIZE = 64  # characters of context


def corpus() -> str:
    return "".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))


def windows(tokens: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inputs ``tokens[s : s + T]`` and next characters ``tokens[s + 1 : s + T + 1]``."""
    idx = starts[:, None] + np.arange(BLOCK_SIZE)[None, :]
    return tokens[idx], tokens[idx + 1]


def held_out_loss(model: nnx.Module, tokens: np.ndarray) -> float:
    starts = np.arange(0, len(tokens) - BLOCK_SIZE - 1, BLOCK_SIZE)[:256]
    loss = nnx.jit(jaxdp.models.model_loss("transformer"))(model, windows(tokens, starts))
    return float(loss)


def sample(model: nnx.Module, prompt: str, chars: list[str], length: int, seed: int = 0) -> str:
    """Samples ``length`` characters after ``prompt`` (temperature 0.8).

    The context is a fixed-size buffer filled from the left; causal attention
    keeps the unfilled right part from affecting the position read.
    """
    index = {c: i for i, c in enumerate(chars)}
    tokens = [index[c] for c in prompt]
    logits_at = nnx.jit(lambda m, window, pos: m(window[None])[0, pos])
    key = jax.random.key(seed)
    for _ in range(length):
        context = tokens[-BLOCK_SIZE:]
        window = np.zeros(BLOCK_SIZE, np.int32)
        window[: len(context)] = context
        logits = logits_at(model, window, len(context) - 1)
        key, sub = jax.random.split(key)
        tokens.append(int(jax.random.categorical(sub, logits / 0.8)))
    return "".join(chars[t] for t in tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 steps instead of 300")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    steps = args.steps or (16 if args.quick else 300)

    jaxdp.emulate_cpu_devices(4)  # CPU only, before JAX starts
    text = corpus()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    tokens = np.fromiter((lookup[c] for c in text), np.int32, len(text))
    cut = int(0.9 * len(tokens))
    train, held_out = tokens[:cut], tokens[cut:]
    print(f"corpus: {len(text):,} characters, {len(chars)} distinct (pydoc_data.topics)")

    sizes = jaxdp.batch_sizes(num_devices=4, accum_steps=2, micro_batch_size=16)
    step = jaxdp.make_train_step(
        jaxdp.models.model_loss("transformer"),  # cross-entropy over all B x T positions, mean
        # Warm-up: 20 steps, or a quarter of a shorter run (--quick).
        optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, 3e-3, min(20, steps // 4), steps, 3e-4)
        ),
        mesh=jaxdp.data_mesh(sizes.num_devices),
        accum_steps=sizes.accum_steps,
    )
    model = jaxdp.models.Transformer(len(chars), BLOCK_SIZE, 128, 4, rngs=nnx.Rngs(0))
    print(f"batch: {sizes.describe()}")
    print(
        f"held-out loss before training: {held_out_loss(model, held_out):.2f} "
        f"(uniform over {len(chars)} characters: {math.log(len(chars)):.2f})"
    )
    state = step.init(model)
    # A data set of window starts; the sampler shuffles them, epoch after epoch.
    num_windows = len(train) - BLOCK_SIZE - 1
    done, epoch = 0, 0
    while done < steps:
        for rows in jaxdp.epoch_schedule(num_windows, sizes, epoch=epoch).rows[: steps - done]:
            state, metrics = step(state, windows(train, rows))
            done += 1
            # Reading the loss waits for the step. Without any wait, dozens of
            # queued steps can stall XLA's CPU all-reduce on a machine with few cores.
            loss = float(metrics["loss"])
            if done % max(steps // 4, 1) == 0:
                print(f"step {done:4d}/{steps}: loss {loss:.2f}")
        epoch += 1

    model = step.model(state)
    print(f"held-out loss after {steps} steps: {held_out_loss(model, held_out):.2f}")
    print("sample:", sample(model, "The ", chars, 80 if args.quick else 300))


if __name__ == "__main__":
    main()

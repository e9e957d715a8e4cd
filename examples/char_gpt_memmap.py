"""The character GPT of char_gpt.py, trained from a token file on disk, with resume.

The corpus (``pydoc_data.topics``, as in char_gpt.py) is written once as a
``uint16`` token file (nanoGPT's ``train.bin`` layout) and opened as an
``np.memmap``: nothing but the rows of each batch is read. Every window of 64
characters is a row of the data set; ``jaxdp.data.Loader`` reads this process's
windows of each global batch on worker threads, in DistributedSampler's order,
and places them on the devices ahead of the step. Checkpoints carry the
loader's position (``save(state, data=loader)``), so ``--resume`` continues at
exactly the windows the run would have read next. The held-out loss is
computed data-parallel (``jaxdp.data.evaluate``).

Run::

    python examples/char_gpt_memmap.py                # 300 steps, checkpoints every 100
    python examples/char_gpt_memmap.py --resume       # continue from the newest checkpoint
    python examples/char_gpt_memmap.py --quick        # 12 steps, checkpoints every 6, for CI

Expected output (``--quick``; the numbers vary a little with the CPU)::

    tokens: /tmp/jaxdp-char-gpt/tokens.u16, 464,970 uint16 (103 distinct)
    batch: global_batch_size=128 = num_devices=4 x accum_steps=2 x micro_batch_size=16
    step    1/12: loss 5.156525
    ...
    step    6/12: loss 3.358639
    checkpoint at step 6: next epoch 0 batch 6
    ...
    step   12/12: loss 3.109145
    checkpoint at step 12: next epoch 0 batch 12
    held-out loss after 12 steps: 3.02

After ``--resume`` from the checkpoint of step 6 (``resumed at step 6: next
SamplerPosition(epoch=0, step_in_epoch=6, micro_batch=0)``) steps 7 to 12 print
the same losses, digit for digit.
"""

import argparse
import json
import pathlib
import tempfile

import numpy as np
import optax
from char_gpt import BLOCK_SIZE, corpus
from flax import nnx

import jaxdp
import jaxdp.data


def write_tokens(directory: pathlib.Path) -> tuple[np.memmap, list[str]]:
    """The corpus as uint16 tokens in ``tokens.u16`` (written once), opened read-only."""
    path, vocab = directory / "tokens.u16", directory / "chars.json"
    if not path.exists():
        text = corpus()
        chars = sorted(set(text))
        lookup = {c: i for i, c in enumerate(chars)}
        directory.mkdir(parents=True, exist_ok=True)
        out = np.memmap(path, np.uint16, mode="w+", shape=(len(text),))
        out[:] = np.fromiter((lookup[c] for c in text), np.uint16, len(text))
        out.flush()
        vocab.write_text(json.dumps(chars))
    return np.memmap(path, np.uint16, mode="r"), json.loads(vocab.read_text())


class Windows:
    """Row ``i``: ``tokens[starts[i] + shift : ... + BLOCK_SIZE]`` as int32, read on demand.

    It has ``shape``, ``dtype`` and ``__getitem__(rows)``, so the loader reads a
    whole call's rows with one fancy index into the memmap."""

    def __init__(self, tokens: np.memmap, starts: np.ndarray, shift: int):
        self.tokens, self.starts, self.shift = tokens, starts, shift
        self.shape, self.dtype = (len(starts), BLOCK_SIZE), np.dtype(np.int32)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        index = self.starts[rows][:, None] + self.shift + np.arange(BLOCK_SIZE)
        return np.asarray(self.tokens[index], np.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="12 steps instead of 300")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--dir", default=str(pathlib.Path(tempfile.gettempdir(), "jaxdp-char-gpt")))
    args = parser.parse_args()
    steps, every = (12, 6) if args.quick else (300, 100)

    jaxdp.emulate_cpu_devices(4)  # CPU only, before JAX starts
    directory = pathlib.Path(args.dir)
    tokens, chars = write_tokens(directory)
    print(f"tokens: {directory / 'tokens.u16'}, {len(tokens):,} uint16 ({len(chars)} distinct)")
    cut = int(0.9 * len(tokens))  # train on the first 90%, hold out the rest
    starts = np.arange(cut - BLOCK_SIZE - 1)  # a window may start at any train position
    source = (Windows(tokens, starts, 0), Windows(tokens, starts, 1))  # inputs, next chars
    held_starts = np.arange(cut, len(tokens) - BLOCK_SIZE - 1, BLOCK_SIZE)[:256]
    held_out = (Windows(tokens, held_starts, 0), Windows(tokens, held_starts, 1))

    sizes = jaxdp.batch_sizes(num_devices=4, accum_steps=2, micro_batch_size=16)
    mesh = jaxdp.data_mesh(sizes.num_devices)
    step = jaxdp.make_train_step(
        jaxdp.models.model_loss("transformer"),  # cross-entropy over all B x T positions, mean
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, steps, 3e-4)),
        mesh=mesh,
        accum_steps=sizes.accum_steps,
    )
    print(f"batch: {sizes.describe()}")
    model = jaxdp.models.Transformer(len(chars), BLOCK_SIZE, 128, 4, rngs=nnx.Rngs(0))
    state = step.init(model)
    loader = jaxdp.data.Loader(source, sizes, mesh=mesh, seed=0, workers=2)
    checkpoints = jaxdp.checkpoint.Checkpoints(directory / "checkpoints", keep=2)
    if args.resume:
        state = checkpoints.restore(state, data=loader).state  # the loader's position too
        print(f"resumed at step {int(state.step)}: next {loader.position}")
    elif checkpoints.steps:
        parser.error(f"{checkpoints.directory} holds checkpoints: pass --resume")

    done = int(state.step)
    # Endless, epoch after epoch; the loop ends after a step, so the loader's position
    # stays the next batch to train on.
    for batch in loader if done < steps else []:
        state, metrics = step(state, batch.data, batch.micro_weights)
        done = int(state.step)  # waits for the step: many queued steps stall CPU all-reduces
        if args.quick or done % 25 == 0:
            print(f"step {done:4d}/{steps}: loss {float(metrics['loss']):.7g}")
        if done % every == 0:
            checkpoints.save(state, data=loader)  # the state and the loader's position
            at = loader.position
            print(f"checkpoint at step {done}: next epoch {at.epoch} batch {at.step_in_epoch}")
        if done >= steps:
            break

    graphdef = state.graphdef

    def window_loss(params, batch):  # one value per window: evaluate masks the padding
        logits = nnx.merge(graphdef, *params)(batch[0])
        return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean(-1)}

    params = (state.params, state.model_state)
    means = jaxdp.data.evaluate(window_loss, params, held_out, mesh=mesh, batch_size=16)
    print(f"held-out loss after {done} steps: {means['loss']:.2f}")


if __name__ == "__main__":
    main()

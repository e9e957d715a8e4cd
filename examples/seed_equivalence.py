"""The seed's demo: gradient accumulation on one device == data parallelism on two.

From "Multiple GPU training in PyTorch and Gradient Accumulation": a
``Linear(8, 1, bias=False)`` with all weights one, ``loss = sum(x @ w)``, the 8
rows of ``torch.manual_seed(0); torch.rand(8, 8)``, micro-batches of 4 rows,
``SGD(lr=0.01, momentum=0.9)``, 2 epochs. Each epoch is one optimizer step over
all 8 rows:

- 1 device, accum_steps=2: micro-batches of 4 rows, the gradients of
  ``loss / 2`` summed, one update (PyTorch: ``no_sync`` + ``loss / accum_steps``);
- 2 devices, accum_steps=1: 4 rows each (``DistributedSampler`` order), the
  gradients averaged by one all-reduce (PyTorch: DDP on 2 ranks).

Both end at the seed's weights. jaxdp does not need torch: without it the data
are the float32 values torch prints, hard-coded below.

Run (``--quick`` is accepted for CI and changes nothing: this takes seconds)::

    python examples/seed_equivalence.py

Expected output::

    data: torch.manual_seed(0); torch.rand(8, 8) (from torch 2.13.0+cpu)
    global_batch_size=8 = num_devices=1 x accum_steps=2 x micro_batch_size=4
      weights: [0.9472, 0.9440, 0.9527, 0.9687, 0.9570, 0.9343, 0.9411, 0.9186]
    global_batch_size=8 = num_devices=2 x accum_steps=1 x micro_batch_size=4
      weights: [0.9472, 0.9440, 0.9527, 0.9687, 0.9570, 0.9343, 0.9411, 0.9186]
    seed's:    [0.9472, 0.9440, 0.9527, 0.9687, 0.9570, 0.9343, 0.9411, 0.9186]
    equivalent: max |1 device - 2 devices| = 0.0e+00
"""

import argparse

import jax
import numpy as np
import optax

import jaxdp

# torch.manual_seed(0); torch.rand(8, 8), as float32 values printed at full precision.
SEED_X = [
    [0.49625658988952637, 0.7682217955589294, 0.08847743272781372, 0.13203048706054688,
     0.30742281675338745, 0.6340786814689636, 0.4900934100151062, 0.8964447379112244],
    [0.455627977848053, 0.6323062777519226, 0.3488934636116028, 0.40171730518341064,
     0.022325754165649414, 0.16885894536972046, 0.2938884496688843, 0.518521785736084],
    [0.6976675987243652, 0.800011396408081, 0.16102945804595947, 0.28226858377456665,
     0.6816085577011108, 0.9151939749717712, 0.39709991216659546, 0.8741558790206909],
    [0.41940832138061523, 0.5529070496559143, 0.9527381062507629, 0.036164820194244385,
     0.1852310299873352, 0.37341737747192383, 0.3051000237464905, 0.9320003986358643],
    [0.17591017484664917, 0.2698335647583008, 0.15067976713180542, 0.03171950578689575,
     0.20812976360321045, 0.9297990202903748, 0.7231091856956482, 0.7423362731933594],
    [0.5262957811355591, 0.24365824460983276, 0.584592342376709, 0.033152639865875244,
     0.13871687650680542, 0.242235004901886, 0.815468966960907, 0.793160617351532],
    [0.2782524824142456, 0.48195880651474, 0.8197803497314453, 0.9970665574073792,
     0.6984410881996155, 0.5675464272499084, 0.8352431654930115, 0.2055988311767578],
    [0.593172013759613, 0.11234724521636963, 0.1534569263458252, 0.24170821905136108,
     0.7262365221977234, 0.7010802030563354, 0.2038237452507019, 0.6510535478591919],
]  # fmt: skip
SEED_WEIGHTS = [0.9472, 0.9440, 0.9527, 0.9687, 0.9570, 0.9343, 0.9411, 0.9186]


def seed_data() -> tuple[np.ndarray, str]:
    """The 8 x 8 inputs, from torch when it is installed."""
    try:
        import torch
    except ImportError:
        return np.asarray(SEED_X, np.float32), "hard-coded"
    torch.manual_seed(0)
    return torch.rand(8, 8).numpy(), f"from torch {torch.__version__}"


def train(x: np.ndarray, *, num_devices: int, accum_steps: int) -> np.ndarray:
    sizes = jaxdp.batch_sizes(num_devices=num_devices, accum_steps=accum_steps, micro_batch_size=4)
    print(sizes.describe())
    step = jaxdp.make_train_step(
        jaxdp.models.model_loss("linear"),  # sum(x @ w) over the micro-batch, as in the seed
        optax.sgd(0.01, momentum=0.9),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
    )
    state = step.init(jaxdp.models.LinearModel())  # Linear(8, 1, bias=False), weights all one
    y = np.zeros((len(x), 1), np.float32)  # unused by the sum loss
    for epoch in range(2):
        for rows in jaxdp.epoch_schedule(len(x), sizes, epoch=epoch, shuffle=False).rows:
            state, _ = step(state, (x[rows], y[rows]))
    weights = np.asarray(jax.device_get(step.model(state).linear.kernel[...])).ravel()
    print("  weights:", _show(weights))
    return weights


def _show(values) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="accepted for CI; no change")
    parser.parse_args()
    jaxdp.emulate_cpu_devices(2)  # CPU only, before JAX starts
    x, source = seed_data()
    print(f"data: torch.manual_seed(0); torch.rand(8, 8) ({source})")
    accumulated = train(x, num_devices=1, accum_steps=2)
    parallel = train(x, num_devices=2, accum_steps=1)
    print("seed's:   ", _show(SEED_WEIGHTS))
    print(f"equivalent: max |1 device - 2 devices| = {np.max(np.abs(accumulated - parallel)):.1e}")


if __name__ == "__main__":
    main()

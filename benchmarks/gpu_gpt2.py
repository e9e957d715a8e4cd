"""GPT-2 small (124M) in bf16 on one GPU: jaxdp's fused step against torch.compile.

On a GPU machine (jax[cuda] and torch installed), from the repository root::

    python benchmarks/gpu_gpt2.py --out benchmarks/results   # then: bin/jaxdp bench --only gpu
    python benchmarks/gpu_gpt2.py --out /tmp/check --tiny     # toy sizes, any machine

The same as ``bin/jaxdp bench --only gpu`` (which also redraws BENCHMARKS.md).
Flags: ``--micro-batch-size`` (16), ``--accum-steps`` (8), ``--no-torch``,
``--no-compile``. The code and the FLOP formula are in ``benchmarks/harness/gpu.py``.
"""

import pathlib
import sys


def main() -> int:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # the checkout
    from benchmarks.harness.gpu import main as gpu_main

    return gpu_main()


if __name__ == "__main__":
    sys.exit(main())

"""``--quick``'s XLA-only measurements in one process:
``python -m benchmarks.harness._together NAME... --out DIR --quick``.

A smoke run's timings are not figures to trust, and most of its cost is starting
JAX and compiling: so overhead, comms, memory and zero share one process, on as
many emulated devices as the largest of them needs, each on the first devices its
mesh names (zero times its steps in this process, not in a worker). A real run
gives each measurement a fresh process (:mod:`._runner`), and vs_torch always
keeps torch and XLA in processes of their own.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ._runner import TOGETHER


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="+", choices=TOGETHER, metavar="NAME")
    p.add_argument("--out", required=True, help="directory for <name>.json")
    p.add_argument("--quick", action="store_true", help="required: smoke sizes only")
    args = p.parse_args(argv)
    if not args.quick:
        p.error("runs only --quick: a real run gives each measurement a fresh process")
    from jaxdp import emulate_cpu_devices

    from . import comms, memory, zero

    emulate_cpu_devices(max(comms.NUM_DEVICES, memory.NUM_DEVICES, zero.QUICK_NUM_DEVICES))
    for name in args.names:
        print(f"jaxdp bench: {name} (with the others in one process) ...", flush=True)
        module = importlib.import_module(f"{__package__}.{name}")
        module.main(["--out", args.out, "--quick"], shared=True)


if __name__ == "__main__":
    main(sys.argv[1:])

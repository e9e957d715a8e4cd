"""All of jaxdp's benchmarks in one command; the same as ``bin/jaxdp bench``.

Run from the repository root::

    python benchmarks/run.py            # the CPU measurements, about 8 minutes on 2 cores
    python benchmarks/run.py --quick    # smoke sizes (what tests/test_bench.py runs)
    python benchmarks/run.py --only gpu # the GPT-2-small GPU figures, on a GPU machine

It writes ``benchmarks/results/*.json`` and ``*.png`` and the generated tables
of ``BENCHMARKS.md``. The code is in ``jaxdp/cli/bench/`` (one module per
measurement), so the installed ``jaxdp bench`` runs it too.
"""

import pathlib
import sys


def main() -> int:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # a checkout's jaxdp
    from jaxdp.cli import main as jaxdp_main

    return jaxdp_main(["bench", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())

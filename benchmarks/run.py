"""All of jaxdp's benchmarks in one command; ``bin/jaxdp bench`` runs this script.

Run from the repository root::

    bin/jaxdp bench                     # the CPU measurements, about 12 minutes on 2 cores
    python benchmarks/run.py --quick    # smoke sizes (what tests/test_bench.py runs)
    python benchmarks/run.py --only gpu # the GPT-2-small GPU figures, on a GPU machine

It writes ``benchmarks/results/*.json`` and ``*.png`` and the generated tables
of ``BENCHMARKS.md``. The code is in ``benchmarks/harness/`` (one module per
measurement), outside the installed package: an installed ``jaxdp`` has no
``bench`` command.
"""

import pathlib
import sys


def main() -> int:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # the checkout
    from benchmarks.harness._runner import main as bench_main

    return bench_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())

"""jaxdp's benchmark harness (``bin/jaxdp bench``, ``benchmarks/run.py``): not part of the
installed package, and it uses only jaxdp's public API.

One module per measurement, each runnable on its own from the repository root as
``python -m benchmarks.harness.<name> --out DIR [--quick]`` and writing
``DIR/<name>.json``; :mod:`benchmarks.harness._runner` runs them in fresh processes
(each sets its own emulated device count before JAX starts; ``--quick``'s XLA-only
ones share one, :mod:`benchmarks.harness._together`) and
:mod:`benchmarks.harness._render` turns the JSON into PNG plots and the tables of
BENCHMARKS.md.
"""

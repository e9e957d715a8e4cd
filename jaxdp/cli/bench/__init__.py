"""jaxdp's benchmarks (``jaxdp bench``, ``benchmarks/run.py``); private, not part of the API.

One module per measurement, each runnable on its own as
``python -m jaxdp.cli.bench.<name> --out DIR [--quick]`` and writing
``DIR/<name>.json``; :mod:`jaxdp.cli.bench._runner` runs them in fresh processes
(each sets its own emulated device count before JAX starts) and
:mod:`jaxdp.cli.bench._render` turns the JSON into PNG plots and the tables of
BENCHMARKS.md.
"""

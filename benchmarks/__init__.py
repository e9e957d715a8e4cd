"""jaxdp's benchmarks, outside the installed package: the scripts here and the harness
(:mod:`benchmarks.harness`). Run from the repository root (``bin/jaxdp bench``)."""

"""tests/gpu: jaxdp's steps compiled by XLA:GPU for H100 topologies on this CPU machine
(:func:`jaxdp.testing.gpu_mesh`). Collected where jax's CUDA plugin is installed: the
newest-jax run (bin/test-newest-jax) installs it; the main run's environment has none
(the root conftest.py leaves this directory out there, and says so).

The plugin looks for a CUDA driver when JAX starts its backends unless JAX runs on the
CPU alone, so the run's processes take ``jax_platforms="cpu"`` before any backend starts:
the emulated CPU devices of tests/conftest.py, and compile-only GPUs beside them.
"""

import jax

jax.config.update("jax_platforms", "cpu")

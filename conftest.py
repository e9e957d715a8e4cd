"""Shared by tests/ and parity_tests/: one persistent XLA compilation cache for the run.

Most of the suite's time is XLA compiling steps (measured: the same 133 tests took
307 s cold and 57 s with every program cached), and many tests compile the same
programs. The cache lives in .jax-cache/ (ignored by git; a fresh clone starts
empty) and is shared through the environment with the processes the tests start
(jaxdp launch ranks, examples, benchmarks). A cached program is the same
executable, so results are bitwise those of compiling it again.
"""

import os
import pathlib

CACHE = pathlib.Path(__file__).parent / ".jax-cache"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# A size bound turns on JAX's file lock around every read and write of the cache:
# without it an entry is written in place, and a test's process could read one half
# written by another's.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 * 2**30))

"""Shared by tests/ and parity_tests/: one persistent XLA compilation cache for the run.

Most of the suite's time is XLA compiling steps (measured: the same 133 tests took
307 s cold and 57 s with every program cached), and many tests compile the same
programs. pytest's own process makes a fresh temporary directory for the run and
points JAX's own persistent cache at it through the environment, so its xdist workers,
the plugin's device workers and the processes the tests start (jaxdp launch ranks,
examples, benchmarks) all read and write the same one: a program is compiled once per
run, not once per process. Nothing leaks between runs (it is removed at the end); set
``JAX_COMPILATION_CACHE_DIR`` to keep one across runs instead (it is then left as it
is). A cached program is the same executable, so results are bitwise those of
compiling it again.
"""

import importlib.util
import json
import os
import pathlib
import resource
import shutil
import tempfile
import time

import pytest

# tests/gpu compiles jaxdp's steps for NVIDIA GPU topologies with XLA:GPU, which needs jax's
# CUDA plugin (no GPU, no driver): bin/test-newest-jax installs it and runs them. An
# environment without it (the main run's .venv, jax 0.10) leaves them out, and the run's
# summary says so.
_GPU_PLUGIN = importlib.util.find_spec("jax_cuda12_plugin") is not None
collect_ignore = [] if _GPU_PLUGIN else ["tests/gpu"]


def pytest_report_header(config):
    if not _GPU_PLUGIN:
        return "tests/gpu left out: no jax CUDA plugin here (bin/test-newest-jax runs them)"
    return None


# The directory this process made for the run (None in a worker, which inherits it, or
# where the caller named one): removed when this process's session ends.
_RUN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _RUN_CACHE = pathlib.Path(tempfile.mkdtemp(prefix="jaxdp-test-xla-cache-"))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_RUN_CACHE)
# Only programs that took 0.1 s or more to compile: a smaller one compiles again about as
# fast as it is read back, and every entry costs every later write. With a size bound
# (below) JAX scans the whole cache directory on each write, under the lock; with every
# eager op cached, a full run wrote about 2,600 entries, and at that size a write cost
# 0.2 s. Measured on two core test files starting from such a cache: 68 CPU s with every
# program cached, 39 with this floor (230 entries written against 25).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# A size bound turns on JAX's file lock around every read and write of the cache:
# without it an entry is written in place, and a test's process could read one half
# written by another's.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 * 2**30))


def pytest_unconfigure(config):
    for made in (_RUN_CACHE, _GPU_KERNELS):
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


# How the suite's programs are compiled: its processes (xdist workers, the processes tests
# start: command lines, launches, docs' pages) compile small models and run them for a few
# steps, so most of the suite's CPU is XLA compiling. Two settings, made here in the
# environment, so that every process of the run (and the persistent cache's keys) has them:
# - JAX's ``jax_disable_most_optimizations`` ("useful if the cost of optimization is greater
#   than that of running a less-optimized program"): LLVM's optimizations off. XLA's HLO
#   passes run as before, so the compiled programs the tests read (collectives, loops, what
#   is hoisted, memory) are the ones users get: tests/core/test_stage3.py's one-gather test
#   still fails without the optimization barrier that stops XLA hoisting the gather.
# - XLA's CPU elemental emitters instead of its MLIR fusion emitters
#   (``--xla_cpu_use_fusion_emitters=false``, jaxlib before 0.11; later ones have only the
#   MLIR ones): the same HLO after fusion, code generated another way.
# Measured: tests/core/test_equivalence.py (one process) 37.8 CPU s with the first alone,
# 19.1 with both; a cold ``jaxdp train`` of the launch tests' MLP 6.9 CPU s at the default
# level, 4.0 with both. At the default level (OPTIMIZED, below): where a test trains a real
# workload (the examples: 123 CPU s unoptimized, 61 optimized), or holds values a last bit
# decides (the BatchNorm parity cells, which diverge from torch at the second step without
# LLVM's optimizations, 1e-3, a ReLU or max-pool kink decided by a last-bit difference;
# jaxdp 0.2's checkpoint continued against its record, made at the default level;
# docs/decisions.md). Their processes get the default level too (the variable is taken
# from their environment). The benchmarks' smoke run is unoptimized: its timings are
# checked for shape only, and bin/jaxdp bench makes the figures.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


def _has_elemental_emitters() -> bool:
    from importlib.metadata import version

    major, minor = (int(x) for x in version("jaxlib").split(".")[:2])
    return (major, minor) < (0, 11)  # an unknown XLA flag aborts the process


def _add_xla_flag(flag: str) -> None:
    """``flag`` appended to XLA_FLAGS unless the environment names it already."""
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


if _has_elemental_emitters():
    _add_xla_flag("--xla_cpu_use_fusion_emitters=false")
# One LLVM module per CPU program, not XLA's default split into parts compiled on a thread
# pool: on two cores busy with three workers, the split's threads cost CPU, not time.
# Measured on jaxlib 0.10 (tests/core/test_equivalence.py and test_zero.py in one
# process, three pairs of runs): 53 to 56 CPU s against 60 to 72; the same on jaxlib 0.12
# (its MLIR emitters), where it is harmless. The same code, only where it is compiled.
_add_xla_flag("--xla_cpu_parallel_codegen_split_count=1")

# tests/gpu's XLA:GPU compiles: kernels' tile configurations left at their defaults
# (``--xla_gpu_autotune_level=0``: without a GPU they come from a cost model, not a
# measurement), ptxas at -O0 and one compile thread (on two busy cores a thread pool
# costs CPU, not time). The tests read the scheduled program and its memory, and these
# are the same: GPT-2 small's stage-0 step compiled for 1x1x8 came out instruction for
# instruction in the same order with the same memory analysis, only the kernels'
# backend_config differing, in 16.1 CPU s against 22.9. And XLA's own kernel cache
# (``--xla_gpu_kernel_cache_file``): a kernel compiled for one program (its LLVM IR, its
# ptxas run) is read back by the next that has it, and the GPT-2 cells share most of
# theirs; it comes after the scheduling and the buffer assignment the tests read (the
# same program text and memory with and without it), and took tests/gpu from 215 to 188
# CPU s. One file per process, removed with it (XLA rewrites the whole file after each
# compile, so two processes must not share one); a process this one starts inherits the
# file and compiles while this one waits.
_GPU_KERNELS = None
if _GPU_PLUGIN:
    _GPU_KERNELS = pathlib.Path(tempfile.mkdtemp(prefix="jaxdp-test-gpu-kernels-"))
    _ours = {
        "--xla_gpu_autotune_level": "0",
        "--xla_gpu_disable_gpuasm_optimizations": "true",
        "--xla_gpu_force_compilation_parallelism": "1",
        "--xla_gpu_kernel_cache_file": str(_GPU_KERNELS / "kernels.bin"),
    }
    # An xdist worker inherits its controller's: each process sets its own.
    _inherited = [
        flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag.split("=")[0] not in _ours
    ]
    os.environ["XLA_FLAGS"] = " ".join(_inherited + [f"{k}={v}" for k, v in _ours.items()])

OPTIMIZED = (
    "tests/test_examples.py",
    "parity_tests/test_parity_model_state.py",
    "tests/test_checkpoint_format2.py",
)


@pytest.fixture(autouse=True)
def _optimized_where_it_pays(request, monkeypatch):
    """OPTIMIZED tests, and the processes they start, compile at JAX's default level."""
    if not request.node.nodeid.startswith(OPTIMIZED):
        yield
        return
    import jax

    monkeypatch.delenv("JAX_DISABLE_MOST_OPTIMIZATIONS", raising=False)
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


def pytest_addoption(parser):
    parser.addoption(
        "--cells-per-test",
        type=int,
        default=None,
        metavar="N",
        help="run at most N parameter cells of each parametrized test, spread evenly over "
        "its grid; 1: its first or last, in turn (bin/test-newest-jax: 1, bin/test "
        "--quick: 2; the main run takes every cell)",
    )


# The files whose tests start real processes to run whole programs (jaxdp launch ranks, the
# command line, torch's DDP ranks, the benchmarks, the examples, the docs' scripts, the
# plugin's example suites, a package build): marked ``slow``, so that a developer's quick
# loop (``bin/test --quick``: ``-m "not slow"``, two cells per parametrized test) leaves
# them to the whole run, which CI makes.
SLOW = (
    "parity_tests/",
    "tests/test_bench.py",
    "tests/test_checkpoint_background.py",
    "tests/test_cli.py",
    "tests/test_distributed.py",
    "tests/test_interrupts.py",
    "tests/test_docs.py",
    "tests/test_examples.py",
    "tests/test_install.py",
    "tests/test_other_launcher.py",
    "tests/test_preemption.py",
    "tests/test_testing_plugin.py",
)


def pytest_collection_modifyitems(config, items):
    """Marks the SLOW files' tests ``slow``; and ``--cells-per-test N``: of each test
    function's cells, N spread evenly in collection order (first and last included), so
    the sample still meets every value of the grid's first parameters; N = 1: the first
    and the last cell in turn from one parametrized function to the next, so the sample
    still meets both ends of the grids (fused and multisteps, shard_map and pmap)."""
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
    n = config.getoption("--cells-per-test")
    # tests/gpu's grids run whole where they run at all (only the newest-jax run can): each
    # cell is a program of its own, compiled for the GPUs.
    sampled = [item for item in items if not item.nodeid.startswith("tests/gpu/")]
    if not n:
        return
    if n < 1:
        raise pytest.UsageError(f"--cells-per-test must be at least 1, got {n}")
    cells: dict[tuple[str, str], list] = {}
    for item in sampled:
        cells.setdefault((item.nodeid.split("::")[0], item.originalname), []).append(item)
    keep = {id(item) for item in items if item.nodeid.startswith("tests/gpu/")}
    grids = 0  # parametrized functions sampled so far
    for group in cells.values():
        if len(group) <= n:
            picked = range(len(group))
        elif n == 1:
            picked, grids = [0 if grids % 2 == 0 else len(group) - 1], grids + 1
        else:
            step = (len(group) - 1) / (n - 1)
            picked = {round(i * step) for i in range(n)}
        keep.update(id(group[i]) for i in picked)
    dropped = [item for item in items if id(item) not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if id(item) in keep]


def _cpu_seconds() -> float:
    """User and system CPU of this process and of the children it has waited for."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if os.environ.get("JAXDP_TEST_CPU_LOG"):
    # JAXDP_TEST_CPU_LOG=FILE: one JSON line per test, its CPU seconds (setup, call and
    # teardown; the processes it started and waited for included, launched ranks through
    # their launcher). On two cores the suite is CPU-bound, so these, not durations
    # (which count the waits for the other workers), say where its time goes; the wall
    # clock at its start and end and the process that ran it (an xdist worker, or the
    # run's own) say when, to find the cores left idle.
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        before, start = _cpu_seconds(), time.time()
        try:
            return (yield)
        finally:
            record = {"test": item.nodeid, "cpu": round(_cpu_seconds() - before, 3)}
            record.update(start=round(start, 2), end=round(time.time(), 2))
            record["worker"] = os.environ.get("PYTEST_XDIST_WORKER", f"pid {os.getpid()}")
            with open(os.environ["JAXDP_TEST_CPU_LOG"], "a") as log:
                log.write(json.dumps(record) + "\n")

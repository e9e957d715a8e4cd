"""The one tree-compare helper and the tolerances it is used with; a port for a coordinator;
whether a test's processes are still running."""

import contextlib
import pathlib
import socket
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

# Relative tolerances per dtype, elementwise.
RTOL = {
    # The bound. Observed: a few 1e-15 (summation order differs between
    # the scan over micro-batches, the all-reduce and one big batch).
    "float64": 1e-12,
    # PyTorch's assertEqual defaults for float32. Observed after 5 steps: at most
    # 1.1e-6 relative on elements near zero and 6e-8 absolute, from the order
    # of summation (per micro-batch, then across devices, vs one big batch).
    "float32": 1.3e-6,
}
# Absolute floors, for elements that pass near zero, where a relative bound means nothing.
ATOL = {
    # An element near zero still carries the rounding of the O(0.1..1) terms summed into
    # it: 1.3e-17 was seen on an element of 5e-6 (jax 0.12, CPU). 1e-15 is a few ulps
    # of 1.0 (float64 eps 2.2e-16), far below any difference a wrong reduction makes.
    "float64": 1e-15,
    "float32": 1e-5,  # PyTorch's assertEqual default for float32
}


def assert_trees_close(actual: Any, expected: Any, *, rtol: float, atol: float = 0.0) -> None:
    """Same structure, and every leaf within ``rtol`` (elementwise) of ``expected``."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


def max_rel_diff(actual: Any, expected: Any) -> float:
    """Largest elementwise |a - b| / |b| over the trees (0/0 counts as 0)."""
    worst = 0.0
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        diff = np.abs(a - b)
        worst = max(worst, float(np.max(np.where(diff == 0, 0.0, diff / np.abs(b)))))
    return worst


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A free local port, held while the block runs, for a JAX coordinator started in it.

    A port found free and released at once can be taken before the coordinator
    binds it. This socket keeps it: bound with SO_REUSEPORT, never listening, so
    JAX's coordinator (gRPC, which sets SO_REUSEPORT too) binds beside it and
    nothing else can (as ``jaxdp launch`` does).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def alive(pid):
    """Running (a zombie left for a non-reaping init to collect counts as ended)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def left_behind(mark):
    """Pids of processes started under ``JAXDP_TEST_MARK=mark`` still running: a rank or
    a launcher of that launch left behind (the mark is unique per launch, so a launch
    of another test running at the same time is never counted)."""
    found = []
    for environ in pathlib.Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"JAXDP_TEST_MARK={mark}".encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)]

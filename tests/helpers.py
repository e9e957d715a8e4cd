"""How far two trees are apart (the tree comparison and its tolerances are
``jaxdp.testing``'s: ``assert_trees_close``, ``TOLERANCES``); a port for a coordinator;
whether a test's processes are still running."""

import contextlib
import pathlib
import socket
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np


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

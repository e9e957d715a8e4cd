"""jaxdp.data.Loader's background threads end with the loop: breaking out, ``close``,
``with``, and a loop left open at interpreter exit (which aborted the process with
status 134 before: a thread left inside JAX's C++ code as the interpreter ended)."""

import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import jaxdp
import jaxdp.data

SIZES = jaxdp.batch_sizes(num_devices=2, accum_steps=2, micro_batch_size=4)
PLACEMENT = "jaxdp-data-place"


def slow(record):
    """A transform slow enough that the placement thread is mid-read when the loop stops."""
    time.sleep(0.02)
    return record


def make_loader(**kwargs):
    source = {"x": np.arange(400, dtype=np.float32)[:, None], "y": np.arange(400)}
    mesh = jaxdp.data_mesh(SIZES.num_devices)
    return jaxdp.data.Loader(source, SIZES, mesh=mesh, transform=slow, shuffle=False, **kwargs)


def placement_threads():
    return {t for t in threading.enumerate() if t.name == PLACEMENT and t.is_alive()}


def test_breaking_out_of_the_loop_leaves_no_thread_running():
    before = placement_threads()
    for i, _ in enumerate(make_loader()):
        if i == 1:
            break
    assert placement_threads() - before == set()


def test_close_ends_a_held_iteration_and_the_next_loop_continues_after_it():
    loader = make_loader()
    before = placement_threads()
    held = iter(loader)
    first = next(held)
    assert placement_threads() - before != set()
    loader.close()
    assert placement_threads() - before == set()
    assert loader.position == first.position
    rows, _ = loader.rows(first.position)  # the call after the first
    second = next(iter(loader))
    assert np.asarray(second.data["y"]).tolist() == rows.tolist()
    assert rows.tolist() != loader.rows((0, 0, 0))[0].tolist()
    loader.close()


def test_leaving_a_with_block_closes_the_loader():
    before = placement_threads()
    with make_loader() as loader:
        held = iter(loader)
        next(held)
    assert placement_threads() - before == set()
    del held


EXIT = """
import jaxdp
jaxdp.emulate_cpu_devices(2)
import numpy as np
import jaxdp.data
sizes = jaxdp.batch_sizes(num_devices=2, accum_steps=2, micro_batch_size=64)
x = np.random.default_rng(0).normal(size=(20000, 64)).astype(np.float32)
loader = jaxdp.data.Loader((x, np.zeros(len(x), np.int32)), sizes, mesh=jaxdp.data_mesh(2))
{ending}
"""
ENDINGS = {
    "break": "for i, _ in enumerate(loader):\n    if i == 3:\n        break",
    "held": "held = iter(loader)\nfor _ in range(3):\n    next(held)",
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_process_that_stops_reading_mid_epoch_exits_0_every_time(ending):
    """Six exits in pairs: before the threads were joined, 7 of 20 ``break`` and 3 of 12
    ``held`` exits aborted (134, "FATAL: exception not rethrown")."""
    code = textwrap.dedent(EXIT).format(ending=ENDINGS[ending])
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def run(_):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(run, range(6)))
    assert [r.returncode for r in runs] == [0] * 6, [r.stderr[-300:] for r in runs]

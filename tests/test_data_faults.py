"""Every fault of the loader ends cleanly (issue 33): Ctrl-C interrupts a loop waiting on
a read that never returns, with the position intact; a source too large for its order is
refused before any allocation; a text or ragged column is named with the fix; a held
iteration ends when its loader is closed."""

import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jaxdp
import jaxdp.data

# datasets is imported where it is used: every xdist worker collects this file, and the
# import costs about 2.7 CPU s.

SIZES = jaxdp.batch_sizes(num_devices=2, accum_steps=1, micro_batch_size=2)


class Declared:
    """A source that declares ``n`` records and reads any of them."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": np.full(3, float(i))}


def loader(source, **kwargs):
    return jaxdp.data.Loader(source, SIZES, mesh=jaxdp.data_mesh(2), shuffle=False, **kwargs)


def test_a_source_whose_order_cannot_fit_in_memory_is_refused_naming_its_length_and_bytes():
    # numpy's "Unable to allocate 7.28 TiB" before, naming no source.
    with pytest.raises(ValueError, match=r"source has 1000000000000 records: .* needs about .*TiB"):
        loader(Declared(10**12))


def test_a_hugging_face_text_column_is_refused_at_construction_naming_it_and_the_fix():
    import datasets

    data = {"x": np.ones((8, 3), np.float32).tolist(), "y": list(range(8)), "text": ["ab"] * 8}
    with pytest.raises(
        ValueError, match=r"column 'text' holds text .*remove_columns\(\['text'\]\)"
    ):
        loader(datasets.Dataset.from_dict(data))
    loader(datasets.Dataset.from_dict(data).remove_columns(["text"])).close()  # the fix works
    # A transform may encode the text: its records are checked when read.
    encoded = loader(datasets.Dataset.from_dict(data), transform=lambda r: {"n": len(r["text"])})
    with encoded:
        assert np.asarray(next(iter(encoded)).data["n"]).tolist() == [2, 2, 2, 2]
    with pytest.raises(ValueError, match=r"source\['name'\] has dtype <U2"):
        loader({"x": np.ones((8, 3)), "name": np.array(["ab"] * 8)})


def test_a_ragged_column_is_refused_at_the_first_batch_naming_the_column_and_records():
    import datasets

    ragged = datasets.Dataset.from_dict({"x": [[1.0] * (1 + i % 2) for i in range(8)]})
    with (
        pytest.raises(
            ValueError,
            match=r"column \['x'\] of the batch of records \[0, 2, 1, 3\] "
            r"has numpy dtype object: its rows have different lengths",
        ),
        loader(ragged) as it,
    ):
        next(iter(it))


def test_a_held_iteration_ends_when_the_loader_is_closed_with_its_position_kept():
    with loader(Declared(64)) as it:
        held = iter(it)
        first = next(held)
        it.close()
        # Before: one more buffered batch, then "the placement thread ended without a batch".
        assert list(held) == []
        assert it.position == first.position == (0, 1, 0)


HANGING = """
import signal, threading, numpy as np, jaxdp, jaxdp.data
# Python's Ctrl-C, whatever this process inherited (a shell's & ignores SIGINT).
signal.signal(signal.SIGINT, signal.default_int_handler)
jaxdp.emulate_cpu_devices(2)

class Hanging:
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 5:
            threading.Event().wait()  # a read that never returns
        return {"x": np.full(3, float(i))}

sizes = jaxdp.batch_sizes(num_devices=2, accum_steps=1, micro_batch_size=2)
loader = jaxdp.data.Loader(Hanging(), sizes, mesh=jaxdp.data_mesh(2), shuffle=False)
try:
    for batch in loader:
        print("batch", tuple(batch.position), flush=True)
except KeyboardInterrupt:
    print("interrupted at", tuple(loader.position), flush=True)
    raise
"""


def test_ctrl_c_interrupts_a_loop_waiting_on_a_read_that_never_returns():
    """Before, SIGINT waited 30 s for the stuck thread, and then the process never exited
    (grain's pool thread, inside the read, is joined at exit)."""
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HANGING)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout.readline() == "batch (0, 1, 0)\n"  # rows 0 to 3; 5 hangs
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    assert "interrupted at (0, 1, 0)\n" in out  # the position: the next call is unread
    assert out.rstrip().endswith("KeyboardInterrupt"), out
    assert process.returncode == -signal.SIGINT, out

"""A resume continues on the data it was saved with: the loader's fingerprint (rows,
fields, a content digest) in every checkpoint, the same data accepted at any path, and
a memmapped file that changes under a running loader caught at the next read."""

import json
import os
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
import jaxdp.data
from jaxdp.checkpoint import CheckpointError, Checkpoints
from jaxdp.cli import main
from jaxdp.data import _fingerprint

SIZES = jaxdp.batch_sizes(num_devices=2, accum_steps=2, micro_batch_size=4)
TRAIN = ["train", "--cpu-devices", "8", "--num-devices", "2", "--no-progress"]


def arrays(seed=0, n=100):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 3)).astype(np.float32), "y": rng.integers(0, 4, n)}


def make_loader(source, **kwargs):
    return jaxdp.data.Loader(source, SIZES, mesh=jaxdp.data_mesh(2), **kwargs)


def test_the_same_data_in_another_object_restores_and_other_contents_are_refused():
    saved = make_loader(arrays()).state()
    assert saved["fingerprint"]["covers"] == "every byte"
    assert make_loader({k: v.copy() for k, v in arrays().items()}).restore(saved) == (0, 0, 0)
    with pytest.raises(ValueError, match=r"other data: the same shapes with other contents"):
        make_loader(arrays(seed=1)).restore(saved)
    labels = {**arrays(), "y": (arrays()["y"] + 1) % 4}
    with pytest.raises(ValueError, match=r"SHA-256 of every byte: [0-9a-f]{16}\.\.\. then"):
        make_loader(labels).restore(saved)
    wider = {**arrays(), "x": arrays()["x"].astype(np.float64)}
    with pytest.raises(ValueError, match=r"\['x'\]: float32\[3\] then, float64\[3\] now"):
        make_loader(wider).restore(saved)


def test_above_the_whole_bound_sampled_rows_are_hashed(monkeypatch):
    monkeypatch.setattr(_fingerprint, "FULL_BYTES", 1000)  # the arrays hold 2,000 bytes
    monkeypatch.setattr(_fingerprint, "SAMPLED_ROWS", 10)  # rows 0, 11, 22, ..., 99
    saved = make_loader(arrays()).state()
    assert saved["fingerprint"]["covers"] == "10 sampled rows"
    changed = arrays()
    changed["x"][11, 0] += 1.0
    with pytest.raises(ValueError, match="SHA-256 of 10 sampled rows"):
        make_loader(changed).restore(saved)


class Records:
    """A record source of a team's own: ``__len__`` and ``__getitem__``, nothing else."""

    def __init__(self, columns):
        self.columns = columns

    def __len__(self):
        return len(self.columns["y"])

    def __getitem__(self, i):
        return {"x": self.columns["x"][i], "y": self.columns["y"][i]}


def grain_dataset(columns):
    import grain

    return grain.MapDataset.source(Records(columns))


def hugging_face(columns):
    import datasets

    return datasets.Dataset.from_dict(columns)


# Row 137 is none of the 64 records the fingerprint sampled before (issue 34, item 2).
@pytest.mark.parametrize(
    ("holder", "named"),
    [
        (Records, r"a [\w.]*test_data_identity\.Records of records"),
        (grain_dataset, r"a grain MapDataset \(SourceMapDataset\)"),
        (hugging_face, r"a Hugging Face datasets\.Dataset"),
    ],
)
def test_one_label_changed_in_a_small_source_of_any_kind_is_refused_naming_it(holder, named):
    saved = make_loader(holder(arrays(n=200))).state()
    kind = "row" if holder is hugging_face else "record"
    assert saved["fingerprint"]["covers"] == f"every {kind}"
    assert make_loader(holder(arrays(n=200))).restore(saved) == (0, 0, 0)
    changed = arrays(n=200)
    changed["y"][137] = (changed["y"][137] + 1) % 4
    with pytest.raises(ValueError, match=rf"SHA-256 of every {kind}: .*; the source is {named}"):
        make_loader(holder(changed)).restore(saved)


def test_above_the_whole_bound_sampled_records_are_hashed(monkeypatch):
    monkeypatch.setattr(_fingerprint, "FULL_BYTES", 1000)  # 100 records of 20 bytes
    monkeypatch.setattr(_fingerprint, "SAMPLED_ROWS", 10)  # records 0, 11, 22, ..., 99
    saved = make_loader(Records(arrays())).state()
    assert saved["fingerprint"]["covers"] == "10 sampled records"
    unseen, seen = arrays(), arrays()
    unseen["y"][12] += 1
    seen["y"][11] += 1
    assert make_loader(Records(unseen)).restore(saved) == (0, 0, 0)
    with pytest.raises(ValueError, match="SHA-256 of 10 sampled records"):
        make_loader(Records(seen)).restore(saved)


def test_digests_of_other_rows_are_not_compared_and_another_kind_of_source_is_named():
    saved = make_loader(Records(arrays())).state()
    before = {**saved, "fingerprint": {**saved["fingerprint"], "covers": "64 sampled records"}}
    before["fingerprint"]["digest"] = "0" * 64  # a digest of other rows than these
    assert make_loader(Records(arrays())).restore(before) == (0, 0, 0)
    wider = {**arrays(), "x": arrays()["x"].astype(np.float64)}
    named = r"the source is array fields \(numpy.ndarray\), saved from a [\w.]*Records of records"
    with pytest.raises(ValueError, match=r"float32\[3\] then, float64\[3\] now; " + named):
        make_loader(wider).restore(saved)


def test_checkpoints_refuse_another_source_before_reading_the_state(tmp_path):
    mesh = jaxdp.data_mesh(2)
    step = jaxdp.make_train_step(
        lambda p, b: jnp.mean((b["x"] @ p) ** 2), optax.sgd(0.1), mesh=mesh, accum_steps=2
    )
    state = step.init(np.ones((3,), np.float32))
    checkpoints = Checkpoints(tmp_path / "ckpt")
    checkpoints.save(state, data=make_loader(arrays()))
    with pytest.raises(CheckpointError, match="saved for other data: the same shapes with other"):
        checkpoints.restore(state, data=make_loader(arrays(seed=1)))
    restored = checkpoints.restore(state, data=make_loader(arrays()))
    assert int(restored.state.step) == 0


def memmapped(folder):
    folder.mkdir()
    for name, value in arrays().items():
        np.save(folder / f"{name}.npy", value)
    return {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in ("x", "y")}


@pytest.mark.parametrize("change", ["rewritten", "truncated"])
def test_a_memmapped_file_that_changes_mid_epoch_is_caught_at_the_next_read(tmp_path, change):
    loader = make_loader(memmapped(tmp_path / "d"), shuffle=False, workers=1, prefetch=1)
    batches = iter(loader)
    next(batches)
    file = tmp_path / "d" / "x.npy"
    if change == "rewritten":
        np.save(file, arrays(seed=1)["x"])  # same size, other values
        os.utime(file, ns=(1, 1))  # a coarse clock could keep the same time
    else:
        with open(file, "r+b") as f:
            f.truncate(200)
    # np.save truncates, then writes the header (128 bytes), then the data: a read in
    # between sees the file at 0 or 128 bytes, one after it the same size rewritten.
    message = (
        "size 1328 -> 200 bytes"
        if change == "truncated"
        else r"size 1328 -> (0|128) bytes|rewritten"
    )
    with pytest.raises(jaxdp.data.DataChangedError, match=f"{file} changed while .*({message})"):
        for _ in batches:  # the calls read ahead before the change are handed out
            pass
    assert loader.position.step_in_epoch >= 1  # where the loop stands: intact


SHRUNK_DURING_A_READ = """
import sys
import numpy as np
from jaxdp.cli._data import Rows
from jaxdp.data import DataChangedError, _source

np.save(sys.argv[1], np.arange(4000, dtype=np.float32).reshape(1000, 4))
x = np.load(sys.argv[1], mmap_mode="r")
source = _source.Source({"x": x})
rows = Rows(x, np.arange(1000)[::-1], np.float64)
assert np.array_equal(source.read(np.arange(10, 20))["x"], np.asarray(x[10:20]))
assert np.array_equal(rows[np.arange(3)], x[[999, 998, 997]].astype(np.float64))
# As if another process truncated the file just after the read's check of it.
_source.check_files = lambda files: None
with open(sys.argv[1], "r+b") as f:
    f.truncate(2000)
for read in (lambda: source.read(np.arange(900, 910)), lambda: rows[np.arange(3)]):
    try:
        read()
    except DataChangedError as e:
        print(e)
    else:
        raise AssertionError("read past the end of a shrunk file")
"""


def test_a_file_shrunk_during_a_read_raises_not_a_bus_error(tmp_path):
    """The race the check before each read leaves: the file shrinks between the check and
    the read (np.save truncates, then writes). Memmapped fields and jaxdp train's rows of a
    memmap are read from the file, so the read comes up short and says so; through the
    mapping it ended the process with SIGBUS (a CI worker, once). A process of its own,
    so a bus error fails this test, not the run."""
    import subprocess
    import sys

    path = tmp_path / "x.npy"
    done = subprocess.run(
        [sys.executable, "-c", SHRUNK_DURING_A_READ, str(path)], capture_output=True, text=True
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    for line in lines:
        assert line.startswith(f"data file {path} changed while the loader reads it (a read of ")
        assert "the file is shorter than when it was opened" in line


# ---- jaxdp train -----------------------------------------------------------------------


def write_data(path, seed=0):
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, size=240)
    x = rng.normal(scale=4.0, size=(3, 6))[y] + np.random.default_rng(seed).normal(size=(240, 6))
    np.savez(path, x=x.astype(np.float32), y=y)


def run_with_checkpoint(tmp_path, data, capsys):
    ckpt = tmp_path / "ckpt"
    assert main([*TRAIN, "--data", data, "--steps", "3", "--checkpoint-dir", str(ckpt)]) == 0
    capsys.readouterr()
    return ckpt


def test_resume_finds_its_data_by_content_not_by_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_data(tmp_path / "d.npz")
    ckpt = run_with_checkpoint(tmp_path, "d.npz", capsys)  # a relative path
    saved = json.loads((ckpt / "3" / "meta" / "metadata").read_text())["extra"]["config"]
    assert saved["data"] == str(tmp_path / "d.npz")  # resolved when given
    # From another directory, with a file of the same name and other contents there:
    # a bare --resume continues on the file it was trained on.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_data(elsewhere / "d.npz", seed=1)
    monkeypatch.chdir(elsewhere)
    flags = ["--checkpoint-dir", str(ckpt), "--resume"]
    assert main([*TRAIN, *flags, "--steps", "4"]) == 0
    assert "resumed from" in capsys.readouterr().out
    # The same data under another path (a copy): accepted.
    shutil.copy(tmp_path / "d.npz", tmp_path / "copy.npz")
    assert main([*TRAIN, *flags, "--steps", "5", "--data", str(tmp_path / "copy.npz")]) == 0
    capsys.readouterr()
    # Other contents of the same shape: one line, exit 2, nothing trained.
    with pytest.raises(SystemExit) as stopped:
        main([*TRAIN, *flags, "--steps", "6", "--data", "d.npz"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdp train: error: checkpoint ") and err.count("\n") == 1
    assert "saved for other data: the same shapes with other contents" in err
    assert Checkpoints(ckpt).steps[-1] == 5


def test_a_data_file_rewritten_under_the_run_stops_it_with_a_checkpoint(
    tmp_path, capsys, monkeypatch
):
    folder = tmp_path / "d"
    folder.mkdir()
    write_data(tmp_path / "d.npz")
    with np.load(tmp_path / "d.npz") as f:
        np.save(folder / "x.npy", f["x"])
        np.save(folder / "y.npy", f["y"])
    from jaxdp.cli._metrics import MetricsLog

    write = MetricsLog.write

    def write_then_rewrite(self, record):
        write(self, record)
        if len(self.records) == 2:
            np.save(folder / "x.npy", np.zeros((240, 6), np.float32))
            os.utime(folder / "x.npy", ns=(1, 1))

    monkeypatch.setattr(MetricsLog, "write", write_then_rewrite)
    ckpt = tmp_path / "ckpt"
    flags = ["--data", str(folder), "--epochs", "50", "--checkpoint-dir", str(ckpt)]
    with pytest.raises(SystemExit) as stopped:
        main([*TRAIN, *flags])
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    assert f"jaxdp train: error: data file {folder / 'x.npy'} changed while" in err
    # The steps trained on the data as they were are kept (read ahead: a few past 2).
    assert Checkpoints(ckpt).steps and Checkpoints(ckpt).steps[-1] >= 2
    assert pathlib.Path(folder / "x.npy").exists()

"""jaxdp train on bad input files and labels: one `jaxdp train: error:` line naming the
file, the array and the rule, exit 2, before anything large is read or any step runs;
the classes it infers said; a run of non-finite steps stopped at exactly the limit."""

import io
import zipfile

import numpy as np
import pytest

from jaxdp.cli import main

TRAIN = ["train", "--cpu-devices", "8", "--num-devices", "2", "--no-progress"]


def blobs(n=200, labels=None):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, size=n) if labels is None else labels
    return rng.normal(size=(n, 6)).astype(np.float32), y


def _with_magic(header):
    """An .npy's magic string and a header declaring ``header``."""
    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(stream, header)
    return stream.getvalue()


def huge_npz(path, rows):
    """A small .npz whose x declares ``rows`` rows of 6 float32 features."""
    x_header = {"descr": "<f4", "fortran_order": False, "shape": (rows, 6)}
    y = io.BytesIO()
    np.save(y, np.zeros(10, np.int64))
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", _with_magic(x_header) + b"\0" * 240)
        archive.writestr("y.npy", y.getvalue())


def write(tmp_path, case):
    """The file of ``case`` under tmp_path; returns its path."""
    path = tmp_path / "d.npz"
    x, y = blobs()
    if case == "empty file":
        path.write_bytes(b"")
    elif case in ("cut in half", "compressed, cut in half"):
        save = np.savez_compressed if case.startswith("compressed") else np.savez
        save(path, x=x, y=y)
        whole = path.read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
    elif case == "x of objects":
        np.savez(path, x=np.array([[1, "a"]] * 200, dtype=object), y=y)
    elif case == "x of strings":
        np.savez(path, x=x.astype(str), y=y)
    elif case == "y of strings":
        np.savez(path, x=x, y=y.astype(str))
    elif case == "no features":
        np.savez(path, x=np.zeros((200, 0), np.float32), y=y)
    elif case == "10**9 rows declared":
        huge_npz(path, 10**9)
    elif case == "10**12 rows in a directory":
        path = tmp_path / "d"
        path.mkdir()
        (path / "x.npy").write_bytes(
            _with_magic({"descr": "<f4", "fortran_order": False, "shape": (10**12, 6)})
        )
        np.save(path / "y.npy", y)
    elif case == "NaN rows":
        x[[3, 150]] = np.nan
        x[7, 2] = np.inf
        np.savez(path, x=x, y=y)
    else:
        labels = {
            "label 2**32 + 3": 2**32 + 3,
            "label 2**31": 2**31,
            "label -1": -1,
            "a stray 5000": 5000,
        }[case]
        y = y.astype(np.int64)
        y[17] = labels
        np.savez(path, x=x, y=y)
    return path


CASES = {
    "empty file": "is not a .npz file numpy can read (a zip of .npy arrays; cut short or "
    "corrupted?): BadZipFile",
    "cut in half": "is not a .npz file numpy can read",
    "compressed, cut in half": "is not a .npz file numpy can read",
    "x of objects": ": array x has dtype object (Python objects); it must hold numbers",
    "x of strings": ": x has dtype <U",
    "y of strings": ": y must hold class indices (integers >= 0), got <U",
    "no features": ": x has shape (200, 0); every row needs at least one feature",
    "10**9 rows declared": ": array x declares shape (1000000000, 6) of float32 (24.0 GB), but "
    "the file holds 240 bytes after its header: cut short or corrupted",
    "10**12 rows in a directory": ": x.npy declares shape (1000000000000, 6) of float32 "
    "(24.0 TB), but the file holds 0 bytes",
    "NaN rows": ": x holds NaN or Inf in 3 row(s): row 3, row 7, row 150; every step that "
    "reads one would be skipped",
    "label 2**32 + 3": ": y holds 1 label(s) outside [0, 2147483648) (int32): row 17 (4294967299)",
    "label 2**31": ": y holds 1 label(s) outside [0, 2147483648) (int32): row 17 (2147483648)",
    "label -1": ": y holds 1 label(s) outside [0, 2147483648) (int32): row 17 (-1)",
    "a stray 5000": ": the largest label is 5000, so 5001 classes, but only 5 of them have a "
    "row (0, 1, 2, 3, 5000): a stray label (row 17 (5000))? Pass --num-classes 5001",
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_file_is_one_usage_error_line(tmp_path, capsys, case):
    path = write(tmp_path, case)
    with pytest.raises(SystemExit) as stopped:
        main([*TRAIN, "--data", str(path), "--steps", "1"])
    assert stopped.value.code == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"jaxdp train: error: data='{path}'"), err
    assert CASES[case] in err and err.count("\n") == 1, err
    assert "held-out accuracy" not in out


def test_the_classes_are_said_and_num_classes_bounds_the_labels(tmp_path, capsys):
    path = write(tmp_path, "a stray 5000")
    assert main([*TRAIN, "--data", str(path), "--steps", "1", "--num-classes", "5001"]) == 0
    assert "classes: 5001 (--num-classes)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*TRAIN, "--data", str(path), "--steps", "1", "--num-classes", "4"])
    assert "y holds 1 label(s) outside [0, 4) (--num-classes 4): row 17 (5000)" in (
        capsys.readouterr().err
    )
    x, y = blobs()
    np.savez(tmp_path / "ok.npz", x=x, y=y)
    assert main([*TRAIN, "--data", str(tmp_path / "ok.npz"), "--steps", "1"]) == 0
    assert "classes: 4 (the largest label + 1)" in capsys.readouterr().out


def test_non_finite_steps_end_the_run_at_exactly_the_limit(tmp_path, capsys):
    # SGD at 1e30: step 2's logits overflow, and every step after is NaN.
    flags = [*TRAIN, "--accum-steps", "1", "--optimizer", "sgd", "--lr", "1e30"]
    with pytest.raises(SystemExit) as stopped:
        main([*flags, "--steps", "50"])
    assert stopped.value.code == 1
    out, err = capsys.readouterr()
    assert "(10 in a row; max_consecutive_skips=10 ends the run)" in out
    assert "(11 in a row" not in out
    assert err == (
        "jaxdp train: error: 10 optimizer steps in a row (the last in epoch 0) had a "
        "non-finite loss or gradients and were skipped: stopped, parameters as after step 1; "
        "no checkpoint was saved. NaN or Inf in the data (x is checked at start up to 256 "
        "MB) or a learning rate too high are the usual causes\n"
    )
    assert ".state" not in err


def test_the_embedded_digits_are_scikit_learns_read_without_importing_it():
    """The default data: scikit-learn's digits file read as its load_digits reads it, the
    same arrays bit for bit, with scikit-learn not imported (its import added 1.2 s to every
    `jaxdp train` start); a subprocess, so this process's imports do not count."""
    import subprocess
    import sys

    code = (
        "import sys; from jaxdp.cli._data import _digits; data, target = _digits(); "
        "assert 'sklearn' not in sys.modules; "
        "from sklearn.datasets import load_digits; d = load_digits(); "
        "assert data.dtype == d.data.dtype and target.dtype == d.target.dtype; "
        "assert data.tobytes() == d.data.tobytes() and target.tobytes() == d.target.tobytes()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]

"""Every `jaxdp train --model` on the digits and on a user's --data; the CNN's input rule;
the persistent compilation cache that a second run reads its programs from."""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from jaxdp.cli import main
from jaxdp.cli._main import train_arguments
from jaxdp.cli._train import TrainConfig, build, load

TRAIN = ["train", "--cpu-devices", "8", "--num-devices", "2", "--no-progress"]


def model_choices():
    """The choices of `jaxdp train --model`, read from its parser: a new one gets tested."""
    parser = argparse.ArgumentParser()
    train_arguments(parser)
    (model,) = [a for a in parser._actions if a.dest == "model"]
    return model.choices


def write_data(path, model, n=240):
    """Three separable classes; rows of 6 features for the MLP, 4x4 images of 2 channels
    for the CNN (a channel count the digits do not have)."""
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, size=n)
    shape = (4, 4, 2) if model == "cnn" else (6,)
    centers = rng.normal(scale=3.0, size=(3, *shape))
    x = centers[y] + rng.normal(size=(n, *shape))
    np.savez(path, x=x.astype(np.float32), y=y)


# The GPT reads the digits' pixels as tokens: the digits only (a test below says so).
RUNS = [(m, d) for m in model_choices() for d in ("digits", "npz") if (m, d) != ("gpt", "npz")]


@pytest.mark.parametrize("model,data", RUNS)
def test_every_model_trains_on_the_digits_and_on_a_users_data(tmp_path, capsys, model, data):
    # 30 steps: the CNN learns the digits slowly (its loss 2.32 -> 2.18 over them).
    flags = ["--model", model, "--steps", "30", "--lr", "1e-2", "--hidden", "16"]
    if model == "gpt":  # the model stage 3 is for: trained with its layers gathered
        flags += ["--zero-stage", "3"]
    metrics, summary = tmp_path / "m.jsonl", tmp_path / "summary.json"
    flags += ["--metrics-out", str(metrics), "--summary-out", str(summary)]
    if data == "npz":
        write_data(tmp_path / "d.npz", model)
        flags += ["--data", str(tmp_path / "d.npz")]
    assert main([*TRAIN, *flags]) == 0
    out, err = capsys.readouterr()
    named = str(tmp_path / "d.npz") if data == "npz" else "digits"
    assert f"jaxdp train: {named} {model.upper()} (float32) on 2 cpu device(s)" in out
    if model == "gpt":  # no warning that the peak is not reduced: scan_layers took the stack
        assert "zero_stage=3: parameters, gradients, gradient accumulator and optimizer " in out
        assert "scan_layers" not in err, err
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 30 and all(np.isfinite(losses)), losses
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.05, losses  # it learns
    assert 0 <= json.loads(summary.read_text())["test_accuracy"] <= 1
    # The suite's cache (conftest.py sets JAX_COMPILATION_CACHE_DIR): kept, and said.
    suite = os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert re.search(
        rf"^compilation cache {re.escape(suite)} \(JAX_COMPILATION_CACHE_DIR\): \d+ program\(s\) "
        r"read, \d+ written$",
        out,
        re.M,
    ), out
    # Sized from the data: the digits are 64 pixels, or 8x8 images of 1 channel.
    config = TrainConfig(model=model, hidden=16, data=flags[-1] if data == "npz" else None)
    split = load(config)
    inputs = {("mlp", "digits"): 64, ("mlp", "npz"): 6, ("cnn", "digits"): 1, ("cnn", "npz"): 2}
    inputs["gpt", "digits"] = 64  # tokens, one per pixel
    assert split.x_train.shape[-1] == inputs[model, data]
    built = build(config, split)
    if model == "gpt":
        assert built.pos_emb.num_embeddings == 64 and built.tok_emb.num_embeddings == 17
        assert split.x_train[:].dtype == np.int32 and split.x_train[:].max() <= 16
        return
    first = built.fc1 if model == "mlp" else built.conv1
    assert first.in_features == inputs[model, data]


def test_zero_stage_3_trains_the_gpt_by_default_and_the_gpt_takes_no_data_of_its_own():
    assert TrainConfig(zero_stage=3).model == "gpt"
    assert TrainConfig().model == "mlp" and TrainConfig(zero_stage=2).model == "mlp"
    assert TrainConfig(zero_stage=3, model="mlp").model == "mlp"  # trained, with a warning
    with pytest.raises(ValueError, match=r"data='d.npz': model='gpt' trains on the digits only"):
        TrainConfig(model="gpt", data="d.npz")
    with pytest.raises(ValueError, match=r"hidden=30 is the GPT's d_model and must be divisible"):
        TrainConfig(model="gpt", hidden=30)


@pytest.mark.parametrize(
    "shape,message",
    [
        (
            (40, 6),
            "x has shape (40, 6); --model cnn needs images [n, h, w] or [n, h, w, channels] "
            "(rows of features: --model mlp, or save x as its images)",
        ),
        ((40, 2, 2, 2, 2), "x has shape (40, 2, 2, 2, 2); --model cnn needs images [n, h, w] "),
        (
            (40, 5, 4),
            "x has shape (40, 5, 4); --model cnn needs an even height and width (a 2x2 "
            "max-pool follows its first convolution), got 5x4",
        ),
    ],
    ids=["rows of features", "5 axes", "odd height"],
)
def test_the_cnn_refuses_data_that_are_not_images_it_can_pool(tmp_path, capsys, shape, message):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros(shape, np.float32), y=np.arange(40) % 2)
    with pytest.raises(SystemExit) as stopped:
        main([*TRAIN, "--model", "cnn", "--data", str(path), "--steps", "1"])
    assert stopped.value.code == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"jaxdp train: error: data='{path}': {message}"), err
    assert err.count("\n") == 1 and "held-out accuracy" not in out


def test_a_compile_cache_that_cannot_be_created_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    where = str(tmp_path / "file" / "xla")
    with pytest.raises(SystemExit) as stopped:
        main([*TRAIN, "--compile-cache", where, "--steps", "1"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        f"jaxdp train: error: compile_cache={where!r} cannot be created or written: "
        f"[Errno 20] Not a directory: {where!r}\n"
    )


def cache_line(done):
    """``(where, read, written)`` of a run's ``compilation cache`` line."""
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("compilation cache")]
    found = re.fullmatch(r"compilation cache (.*): (\d+) program\(s\) read, (\d+) written", line)
    assert found, line
    return found.group(1), int(found.group(2)), int(found.group(3))


# The suite's compilation-cache settings (conftest.py), left out where jaxdp's own are tested.
CACHE_SETTINGS = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAX_ENABLE_COMPILATION_CACHE")


def test_a_second_run_reads_the_programs_the_first_wrote(tmp_path):
    """In fresh processes (JAX opens its cache once per process), with none of the suite's
    cache settings: jaxdp's own, in the per-user directory under $XDG_CACHE_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(CACHE_SETTINGS)}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    # Every program, however fast it compiles: whether one takes jaxdp's 0.1 s floor depends
    # on the load (CI saw a seventh program cross it in the third run), and this test counts
    # programs. The environment's value is kept over jaxdp's, as a user's would be.
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    cache = tmp_path / "cache" / "jaxdp" / "xla"
    command = [sys.executable, "-m", "jaxdp", "train", "--cpu-devices", "1", "--accum-steps", "1"]
    command += ["--hidden", "8", "--steps", "1", "--no-progress"]

    def run(*flags, **more):
        return subprocess.run(
            [*command, *flags], capture_output=True, text=True, env={**env, **more}, timeout=300
        )

    where, read, written = cache_line(run())
    assert (where, read) == (str(cache), 0) and written > 0
    entries = sorted(p.name for p in cache.glob("*-cache"))
    assert len(entries) == written
    assert (cache / ".lockfile").exists()  # the size bound's lock: no half-written read
    stamps = {p.name: p.read_bytes() for p in cache.glob("*-atime")}  # rewritten by a read
    off = run("--no-compile-cache")
    assert off.returncode == 0, off.stderr[-3000:]
    assert "compilation cache: off (--no-compile-cache)\n" in off.stdout
    assert {p.name: p.read_bytes() for p in cache.glob("*-atime")} == stamps  # nothing read
    assert sorted(p.name for p in cache.glob("*-cache")) == entries  # nothing written
    # --compile-cache wins over JAX_COMPILATION_CACHE_DIR, and the same run reads every
    # program the first one wrote.
    elsewhere = str(tmp_path / "unused")
    again = run("--compile-cache", str(cache), JAX_COMPILATION_CACHE_DIR=elsewhere)
    assert cache_line(again) == (str(cache), written, 0)
    assert not pathlib.Path(elsewhere).exists()


# A disk that fills up after the compilation cache's first entry and its stamp: every later
# write into the cache writes half its bytes, then fails as a full disk does (ENOSPC).
FULL_DISK = """
import errno, os, sys
import jax._src.path as jax_path
cache = sys.argv[1]
kind = type(jax_path.Path(cache))  # what JAX's cache writes with (etils' or pathlib's)
real = kind.write_bytes
full = []

def write_bytes(self, data):
    if not str(self).startswith(cache + os.sep):
        return real(self, data)
    if full:
        real(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
    full.extend([True] * str(self).endswith("-atime"))
    return real(self, data)

kind.write_bytes = write_bytes
from jaxdp.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_full_disk_is_named_once_and_only_the_entries_kept_are_counted(tmp_path):
    """Issue 33.6: on a full disk the warnings blamed FileNotFoundError (a half-written
    entry without its stamp broke every later write) and the run said "17 written" with
    one entry kept. One warning names the disk; the count is what was kept; the half
    entries are removed, so the directory holds whole entries only."""
    cache = tmp_path / "xla"
    env = {k: v for k, v in os.environ.items() if not k.startswith(CACHE_SETTINGS)}  # jaxdp's
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # every program
    command = [sys.executable, "-c", FULL_DISK, str(cache), "train", "--cpu-devices", "1"]
    command += ["--accum-steps", "1", "--hidden", "8", "--steps", "1", "--no-progress"]
    done = subprocess.run(
        [*command, "--compile-cache", str(cache)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [x for x in done.stderr.splitlines() if x.startswith("jaxdp train: warning:")]
    assert len(warned) == 1, done.stderr[-3000:]
    assert warned[0].startswith(
        f"jaxdp train: warning: compilation cache {cache}: no space left on device writing "
        "the program '"
    )
    assert "FileNotFoundError" not in done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("compilation cache")]
    found = re.fullmatch(
        rf"compilation cache {re.escape(str(cache))}: 0 program\(s\) read, 1 written, (\d+) "
        r"not written \(no space left on device\)",
        line,
    )
    assert found and int(found.group(1)) > 0, line
    entries = sorted(p.name.removesuffix("-cache") for p in cache.glob("*-cache"))
    assert len(entries) == 1
    assert sorted(p.name.removesuffix("-atime") for p in cache.glob("*-atime")) == entries


def test_at_stage_3_the_state_jaxdp_train_checks_against_memory_is_all_split():
    """The least a device holds (jaxdp train's refusal of a model too large, before it is
    built): at stage 3 weights and gradients are split too; the layer it gathers while a
    micro-batch runs is a temporary, not counted."""
    from jaxdp.cli._fits import state_bytes

    need, parts = state_bytes(TrainConfig(zero_stage=3), 1000, 4)
    assert need == 1000 * (4 + 4 + 8 + 4) / 4
    assert parts == (
        "weights 4/4 + gradients 4/4 + AdamW's 2 moments 8/4 + the accumulator 4/4 bytes per "
        "parameter"
    )

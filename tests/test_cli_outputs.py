"""Outputs shared between runs: --metrics-out and --tensorboard are held for one run at a
time like the checkpoint directory, a fresh run never overwrites another's records (nor its
--summary-out or --plot), and a
folder that cannot take the run's events is refused before the first step."""

import json
import os

import pytest

from jaxdp.cli import _outputs, main

TRAIN = ["train", "--cpu-devices", "8", "--num-devices", "2", "--no-progress", "--steps", "2"]


def usage_error(capsys, flags):
    """The one error line of a run refused before its first step."""
    with pytest.raises(SystemExit) as stopped:
        main([*TRAIN, *flags])
    assert stopped.value.code == 2
    out, err = capsys.readouterr()
    assert err.startswith("jaxdp train: error: ") and err.count("\n") == 1, err
    assert "held-out accuracy" not in out
    return err


@pytest.mark.parametrize("option", ["metrics_out", "tensorboard"])
def test_an_output_in_use_by_a_live_run_is_refused_naming_it(tmp_path, capsys, option):
    path = str(tmp_path / ("m.jsonl" if option == "metrics_out" else "tb"))
    files = {"metrics_out": path} if option == "metrics_out" else {}
    board = path if option == "tensorboard" else None
    with _outputs.claimed(files, None, tensorboard=board):  # a live run's hold
        err = usage_error(capsys, ["--" + option.replace("_", "-"), path])
    assert f"{option}={path!r} is in use by another run: host " in err
    assert f"pid {os.getpid()}" in err


def test_a_fresh_run_never_overwrites_another_runs_records(tmp_path, capsys):
    metrics, board = tmp_path / "m.jsonl", tmp_path / "tb"
    assert main([*TRAIN, "--metrics-out", str(metrics), "--tensorboard", str(board)]) == 0
    capsys.readouterr()
    before = metrics.read_text()
    assert before.count("\n") == 2
    events = list(board.glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].name.endswith(f".{os.getpid()}")
    err = usage_error(capsys, ["--metrics-out", str(metrics)])
    assert f"metrics_out={str(metrics)!r} holds 2 record(s) of another run" in err
    err = usage_error(capsys, ["--tensorboard", str(board)])
    assert f"tensorboard={str(board)!r} holds event files of another run (events.out" in err
    assert metrics.read_text() == before
    assert list(board.glob("events.out.tfevents.*")) == events
    assert not list(tmp_path.glob(".*lock")) and not (board / "jaxdp.lock").exists()


def test_a_fresh_run_never_overwrites_another_runs_summary_or_plot_and_a_resume_does(
    tmp_path, capsys
):
    """Issue 33.5: --summary-out and --plot of a finished run were overwritten without a
    word where --metrics-out and --tensorboard refuse; they refuse alike, and a resume of
    that run continues them."""
    summary, plot, checkpoints = tmp_path / "s.json", tmp_path / "p.png", tmp_path / "c"
    outputs = ["--summary-out", str(summary), "--plot", str(plot)]
    assert main([*TRAIN, *outputs, "--checkpoint-dir", str(checkpoints)]) == 0
    capsys.readouterr()
    before = {path: path.read_bytes() for path in (summary, plot)}
    err = usage_error(capsys, ["--summary-out", str(summary)])
    assert err == (
        f"jaxdp train: error: summary_out={str(summary)!r} holds the summary of another run "
        f"({len(before[summary])} bytes); a new run would overwrite it: choose another file "
        "(or remove that one), or resume that run (--resume)\n"
    )
    err = usage_error(capsys, ["--plot", str(plot)])
    assert f"plot={str(plot)!r} holds the plot of another run ({len(before[plot])} bytes)" in err
    assert {path: path.read_bytes() for path in before} == before
    resumed = [*outputs, "--checkpoint-dir", str(checkpoints), "--resume", "--steps", "3"]
    assert main([*TRAIN, *resumed]) == 0
    assert json.loads(summary.read_text())["steps"] == 3 and plot.read_bytes() != before[plot]


@pytest.mark.parametrize("option", ["metrics_out", "tensorboard"])
def test_a_resume_that_finds_no_checkpoint_refuses_another_runs_records(tmp_path, capsys, option):
    """``--resume`` on a directory without checkpoints starts fresh (a requeue before the
    first checkpoint), and a fresh start never overwrites another run's records (23.5)."""
    path = tmp_path / ("m.jsonl" if option == "metrics_out" else "tb")
    flag = "--" + option.replace("_", "-")
    assert main([*TRAIN, flag, str(path)]) == 0  # another run's records
    capsys.readouterr()
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file())
    err = usage_error(
        capsys, [flag, str(path), "--checkpoint-dir", str(tmp_path / "c"), "--resume"]
    )
    assert f"{option}={str(path)!r} holds " in err and " of another run" in err
    assert sorted((p.name, p.read_bytes()) for p in tmp_path.rglob("*") if p.is_file()) == before


def test_a_tensorboard_path_that_is_a_file_is_refused_before_the_first_step(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    err = usage_error(capsys, ["--tensorboard", str(tmp_path / "file")])
    assert f"tensorboard={str(tmp_path / 'file')!r} is a file; it must name a directory" in err

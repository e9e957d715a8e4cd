"""The command line: `jaxdp train` on its defaults, resume, help, version, the cli extra."""

import importlib.metadata
import json
import math
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import jaxdp
from jaxdp.cli import main
from jaxdp.cli._metrics import MetricsLog, plot_training
from jaxdp.cli._train import TrainConfig, build, make_step, train
from jaxdp.testing import TOLERANCES


# These two run the command in a worker of jaxdp's pytest plugin started with the devices
# it asks for. The suite's float64 (tests/conftest.py) changes none of their numbers: the
# runs are float32, their summaries those of a shell's run but for the seconds.
@pytest.mark.devices(4)  # jaxdp train's default --cpu-devices
def test_default_train_run_reaches_the_stated_accuracy(tmp_path, capsys):
    summary, metrics = tmp_path / "summary.json", tmp_path / "metrics.jsonl"
    flags = ["--summary-out", str(summary), "--metrics-out", str(metrics)]
    # --progress: tqdm's bar on stderr, though it is not a terminal.
    assert main(["train", *flags, "--progress"]) == 0
    out = capsys.readouterr()
    assert "loss=" in out.err and "samples_s=" in out.err, out.err[-500:]
    assert (
        "batch: global_batch_size=128 = num_devices=4 x accum_steps=2 x micro_batch_size=16"
    ) in out.out
    result = json.loads(summary.read_text())
    # README.md states "about 98%"; 97% leaves room for other CPUs' rounding.
    assert result["test_accuracy"] >= 0.97
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, result["steps"] + 1))
    assert records[-1]["loss"] < records[0]["loss"] / 5
    assert {"loss", "grad_norm", "learning_rate", "samples_per_s"} <= set(records[0])
    # Throughput is measured from the end of the first update, which compiles.
    assert records[0]["samples_per_s"] is None
    assert all(r["samples_per_s"] > 0 for r in records[1:])


@pytest.mark.devices(2)
def test_multisteps_pmap_run_on_other_sizes(tmp_path):
    summary = tmp_path / "summary.json"
    flags = ["--cpu-devices", "2", "--accum-steps", "4", "--micro-batch-size", "8"]
    flags += ["--path", "multisteps", "--strategy", "pmap", "--epochs", "3"]
    assert main(["train", *flags, "--summary-out", str(summary)]) == 0
    result = json.loads(summary.read_text())
    # 1438 rows over 2 ranks: 719 each, 22 steps of 4 x 8 per epoch.
    assert result["steps"] == 3 * 22
    assert result["test_accuracy"] >= 0.9


def test_sigterm_saves_a_checkpoint_where_it_stops_and_resume_continues(tmp_path, capsys):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    # In this process (8 emulated devices, see conftest), 4 of them.
    flags = ["train", "--cpu-devices", "8", "--num-devices", "4", "--path", "multisteps"]
    flags += ["--checkpoint-dir", str(ckpt), "--metrics-out", str(metrics)]

    def terminate_once_training():
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_once_training, daemon=True).start()
    assert main([*flags, "--epochs", "1000"]) == 128 + signal.SIGTERM
    assert "SIGTERM: stopping after this micro-batch" in capsys.readouterr().err
    (saved,) = list(ckpt.iterdir())
    meta = json.loads((saved / "meta" / "metadata").read_text())
    # Named by the updates applied; stopped after some micro-batch: whole steps of
    # 128 rows plus micro-batches of 4 x 16.
    assert int(saved.name) == meta["step"]
    assert meta["samples"] == meta["step"] * 128 + meta["position"]["micro_batch"] * 64
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] == meta["step"]
    steps = meta["step"] + 2
    # As if the stopped run had been SIGKILLed instead: its lock file is left behind.
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = ended.pid if ended.wait() == 0 else None
    stale = {"host": socket.gethostname(), "pid": dead, "since": "then", "command": "jaxdp train"}
    (ckpt / "jaxdp.lock").write_text(json.dumps(stale))
    # The plot and summary go to folders that do not exist yet: made before the first step.
    plot, summary = tmp_path / "plots" / "a.png", tmp_path / "out" / "summary.json"
    more = ["--steps", str(steps), "--plot", str(plot), "--summary-out", str(summary)]
    assert main([*flags, "--resume", *more]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {saved}: step {meta['step']}" in out
    assert (
        f"took over the lock of {ckpt}, left by a run that is no longer running (host "
        f"{stale['host']}, pid {dead} (jaxdp train, since then))"
    ) in out
    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, steps + 1))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(summary.read_text())["steps"] == steps
    assert not (ckpt / "jaxdp.lock").exists()  # released at the end


# In this process JAX runs on 8 emulated CPU devices (conftest); jaxdp train must
# not ask for another count (its default is 4).
TRAIN = ["train", "--cpu-devices", "8"]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--resume"], "resume=True needs a checkpoint_dir"),
        (["--checkpoint-every", "10"], "checkpoint_every=10 needs a checkpoint_dir"),
        (["--steps", "0"], "steps=0 must be a positive integer"),
        (["--plot", "loss.svg"], "plot='loss.svg' must name a .png file"),
        (["--accum-steps", "0"], "accum_steps=0 must be a positive integer"),
        (["--micro-batch-size", "-1"], "micro_batch_size=-1 must be a positive integer"),
        (["--num-devices", "0"], "num_devices=0 must be a positive integer"),
        (["--epochs", "-2"], "epochs=-2 must be a positive integer"),
        (["--keep", "0"], "keep=0 must be a positive integer"),
        (["--hidden", "0"], "hidden=0 must be a positive integer"),
        (["--cpu-devices", "0"], "cpu_devices=0 must be a positive integer"),
        (
            ["--seed", "-1"],
            "seed=-1 must be an integer in [0, 2**32) (numpy's and scikit-learn's seeds; "
            "JAX's key would drop higher bits)",
        ),
        *(
            (
                [f"--learning-rate={lr}"],
                f"learning_rate={float(lr)!r} must be a finite number >= 0 (as torch.optim "
                "requires; a negative one ascends the loss)",
            )
            for lr in ("nan", "inf", "-inf", "-0.1")
        ),
        (
            ["--zero-stage", "1", "--strategy", "pmap"],
            "zero_stage=1 needs strategy='shard_map' (the legacy pmap strategy keeps every "
            "leaf replicated); use strategy='shard_map' or zero_stage=0",
        ),
        (
            ["--zero-stage", "3", "--data", "/x.npz"],
            "data='/x.npz': model='gpt' trains on the digits only (their 64 pixels as tokens); "
            "choose model='mlp' or 'cnn' for data of your own",
        ),
        (
            ["--zero-stage", "3", "--strategy", "pmap"],
            "zero_stage=3 needs strategy='shard_map' (the legacy pmap strategy keeps every "
            "leaf replicated); use strategy='shard_map' or zero_stage=0",
        ),
        # HSDP (issue 32): --shards with stage 3 only, at least 2, dividing the devices;
        # all but the last before JAX starts, the last the library's own check.
        *(
            (
                flags,
                f"shards=2 needs zero_stage=3 (--shards needs --zero-stage 3: HSDP splits the "
                f"parameters over each shard group), got zero_stage={stage}: stages 0 to 2 "
                "keep every parameter whole on every device",
            )
            for stage, flags in (
                (0, ["--shards", "2"]),
                (2, ["--zero-stage", "2", "--shards", "2"]),
            )
        ),
        (
            ["--zero-stage", "3", "--shards", "1"],
            "shards=1 must be an integer of at least 2 (devices per shard group); one device "
            "per group keeps a whole copy on every device: that is zero_stage=0 (DDP)",
        ),
        (
            ["--zero-stage", "3", "--shards", "3", "--num-devices", "4"],
            "shards=3 must divide num_devices=4 (the devices form num_devices // shards "
            "replica groups of shards devices each)",
        ),
        (
            ["--zero-stage", "3", "--shards", "3"],
            "shards=3 must divide num_devices=8 (the mesh's devices form num_devices // "
            "shards replica groups of shards devices each)",
        ),
        (
            ["--num-devices", "99"],
            "num_devices=99 exceeds the 8 cpu device(s) there are (--cpu-devices sets how many "
            "CPU devices to emulate)",
        ),
        # Tensor parallelism: the GPT's plan only, whole heads, one data axis, the devices.
        (
            ["--model", "mlp", "--tp", "2"],
            "tp=2 needs model='gpt' (--tp needs --model gpt, the model with a tensor-parallel "
            "plan: Megatron's, over its attention heads and MLP); model='mlp' has none",
        ),
        (
            ["--tp", "3"],
            "tp=3 must divide the GPT's 4 attention heads (Megatron's plan gives each device "
            "of the model axis whole heads)",
        ),
        (
            ["--zero-stage", "3", "--shards", "2", "--tp", "2"],
            "tp=2 with shards=2: jaxdp train's HSDP takes no model axis yet; leave out "
            "--shards (--zero-stage 0 to 3 split over the data ranks)",
        ),
        (["--tp", "0"], "tp=0 must be a positive integer"),
        (
            ["--tp", "2", "--strategy", "pmap"],
            "tp=2 needs strategy='shard_map' (the model axis is XLA's partitioner's), got "
            "strategy='pmap'",
        ),
        (
            ["--tp", "2", "--num-devices", "8"],
            "num_devices=8 x tp=2 exceeds the 8 cpu device(s) there are (--cpu-devices sets "
            "how many CPU devices to emulate)",
        ),
        (
            ["--micro-batch-size", "1000"],
            "dataset_size=1438 gives each of num_devices=8 ranks 180 samples, fewer than one "
            "optimizer step needs (accum_steps * micro_batch_size = 2 * 1000)",
        ),
    ],
)
def test_usage_errors_exit_2_with_one_line_before_training(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*TRAIN, *flags])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert err == f"jaxdp train: error: {message}\n"
    assert "held-out accuracy" not in out  # nothing trained


class OnProcess:
    """A device as process ``process_index`` of a multi-process run would see it (the
    library's shard-group check reads ``process_index``)."""

    def __init__(self, device, process_index):
        self.id, self.platform, self.process_index = device.id, device.platform, process_index


def test_shard_groups_spanning_processes_are_one_line_before_training(monkeypatch, capsys):
    """Issue 32: with several processes each HSDP shard group must be one process's
    devices; the library refuses a mesh where it is not, and jaxdp train says so in one
    line, exit 2, before any step (a real two-process refusal costs a launch: the mesh
    is the two processes' devices, interleaved)."""
    import jax

    from jaxdp.cli import _train

    devices = [OnProcess(d, p) for d, p in zip(jax.devices()[:4], [0, 1, 0, 1], strict=True)]
    monkeypatch.setattr(
        _train, "data_mesh", lambda n: jax.sharding.Mesh(np.array(devices), ("data",))
    )
    with pytest.raises(SystemExit) as exit_:
        main([*TRAIN, "--zero-stage", "3", "--shards", "2", "--num-devices", "4"])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert err == (
        "jaxdp train: error: shards=2: every shard group's devices must belong to one "
        "process (its gathers and reduce-scatters stay on one host), but mesh devices "
        f"{[devices[0].id, devices[1].id]} belong to processes [0, 1]; use shards dividing "
        "the devices per process\n"
    )
    assert "held-out accuracy" not in out


def test_shards_of_every_device_is_plain_stage_3():
    """--shards N (one group of all N devices) is --zero-stage 3's own layout: the step
    runs on the one-axis data mesh, as without the flag (also across processes, where
    groups smaller than N must stay within one)."""
    step, _ = make_step(TrainConfig(zero_stage=3, shards=4, num_devices=4))
    assert step.options.device_mesh.axis_names == ("data",)
    step, _ = make_step(TrainConfig(zero_stage=3, shards=2, num_devices=4))
    assert step.options.device_mesh.devices.shape == (2, 2)


def test_tp_trains_the_gpt_split_over_a_model_axis_as_without_it(tmp_path, capsys):
    """``--tp 2 --num-devices 2``: 2 data ranks of 2 devices on a (data, model) mesh, the
    GPT's kernels resting split over "model" by Megatron's plan; in float64 its losses
    and gradient norms are those of the same run on 2 devices without a model axis."""
    assert TrainConfig(tp=2).model == "gpt"  # the default with --tp: the model with a plan
    step, sizes = make_step(TrainConfig(tp=2, num_devices=2, hidden=8))
    assert step.mesh.axis_names == ("data", "model") and step.mesh.devices.shape == (2, 2)
    assert sizes.num_devices == 2 and step.options.model_axes == ("model",)
    abstract = step.abstract_state(build(TrainConfig(tp=2, hidden=8)))
    split = [
        x.sharding.spec for x in jax.tree.leaves(abstract.params) if "model" in x.sharding.spec
    ]
    assert len(split) == 9, split  # query, key, value, attn.proj, fc, mlp.proj; 3 biases

    flags = ["--model", "gpt", "--num-devices", "2", "--hidden", "8", "--steps", "2"]
    flags += ["--accum-steps", "1", "--micro-batch-size", "4", "--precision", "float64"]
    records = {}
    for tp in (2, 1):
        metrics = tmp_path / f"tp{tp}.jsonl"
        flags_tp = ["--tp", str(tp), "--metrics-out", str(metrics), "--no-progress"]
        assert main([*TRAIN, *flags, *flags_tp]) == 0
        records[tp] = [json.loads(line) for line in metrics.read_text().splitlines()]
        if tp == 2:
            out = capsys.readouterr().out
            assert "digits GPT (float64) on 4 cpu device(s)" in out, out
            assert "tensor parallelism: 2 data rank(s) of tp=2 devices on a model axis" in out
    assert [r["step"] for r in records[2]] == [1, 2]
    for key in ("loss", "grad_norm"):
        got, want = [r[key] for r in records[2]], [r[key] for r in records[1]]
        np.testing.assert_allclose(got, want, rtol=TOLERANCES["float64"].rtol)


def test_parity_refuses_tp_on_a_model_torch_ref_has_no_plan_for_before_training(
    monkeypatch, capsys
):
    """jaxdp's transformer has a Megatron plan, torch_ref's not (yet): ``jaxdp parity
    --model transformer --tp 2`` is torch_ref's one-line refusal before either side trains,
    not a traceback after jaxdp's run."""
    monkeypatch.setattr("jaxdp.parity.run_parity", lambda config: pytest.fail("it trained"))
    monkeypatch.setattr("jaxdp._mesh.emulate_cpu_devices", lambda num_devices: None)
    with pytest.raises(SystemExit) as exit_:
        main(["parity", "--model", "transformer", "--num-devices", "2", "--tp", "2"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "jaxdp parity: error: tp=2 needs a model with a Megatron plan: 'stack' "
        "(torch_ref.tensor_parallel.MEGATRON_PLANS), got model='transformer'\n"
    )


@pytest.mark.parametrize(
    "flags,per_param,per_device",
    [
        ([], "weights 4 + gradients 4 + AdamW's 2 moments 8 + the accumulator 4", 20),
        (
            ["--optimizer", "sgd", "--zero-stage", "2", "--num-devices", "4"],
            "weights 4 + gradients 4 + SGD's momentum 4/4 + the accumulator 4/4",
            10,
        ),
    ],
)
def test_a_model_the_machine_cannot_hold_is_refused_before_it_is_built(
    flags, per_param, per_device, capsys
):
    """Issue 33.3: --hidden 3000000 (9e12 parameters) ended in a traceback after 56 s. The
    training state is sized from the traced shapes (nothing allocated) and held against
    the machine's memory: one line naming the flag, the parameters and the bytes."""
    with pytest.raises(SystemExit) as exit_:
        main([*TRAIN, "--hidden", "3000000", *flags])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    params = 64 * 3_000_000 + 3_000_000 + 3_000_000**2 + 3_000_000 + 3_000_000 * 10 + 10
    devices = 4 if "--num-devices" in flags else 8
    need = params * per_device
    assert err.startswith(
        f"jaxdp train: error: hidden=3000000: the MLP 64-3000000-3000000-10: {params:,} "
        f"parameters, whose training state needs at least {need / 1e12:.1f} TB ({need:.3g} "
        f"bytes) per device, {need * devices / 1e12:.1f} TB ({need * devices:.3g} bytes) for "
        f"this process's {devices} CPU device(s) ({per_param} bytes per parameter), and this "
        "machine has "
    ), err
    assert err.endswith(": choose a smaller --hidden (or fewer devices per process, on CPU)\n")
    assert err.count("\n") == 1 and out == ""  # before anything, the batch line included


@pytest.mark.parametrize(
    "where,message",
    [
        ("file", "checkpoint_dir='{file}' is a file, not a directory"),
        ("file/ckpt", "checkpoint_dir='{file}/ckpt' is inside {file}, which is a file, not a "),
        ("file/m.jsonl", "metrics_out='{file}/m.jsonl' is inside {file}, which is a file"),
        ("file/tb", "tensorboard='{file}/tb' cannot be created: [Errno 20] Not a directory"),
    ],
)
def test_an_output_path_inside_a_file_is_a_usage_error(tmp_path, capsys, where, message):
    file = tmp_path / "file"
    file.write_text("")
    flag = "--checkpoint-dir"
    if where.endswith(".jsonl"):
        flag = "--metrics-out"
    elif where.endswith("/tb"):
        flag = "--tensorboard"
    with pytest.raises(SystemExit) as exit_:
        main([*TRAIN, flag, str(tmp_path / where)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxdp train: error: {message.format(file=file)}")
    assert err.count("\n") == 1


def unprivileged():
    """A command prefix under which mode bits bind: root without its capabilities."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only directory cannot be made")
    return ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--plot", "--tensorboard"])
def test_an_unwritable_output_stops_the_run_before_its_first_step(tmp_path, flag):
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    target = read_only / ("ckpt" if flag == "--checkpoint-dir" else "loss.png")
    if flag == "--tensorboard":
        target = read_only  # an existing folder that takes no file
    done = subprocess.run(
        [*unprivileged(), sys.executable, "-m", "jaxdp", "train", "--steps", "1", flag, target],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    if flag == "--plot":
        expected = f"plot='{target}' cannot be written (Permission denied: "
    elif flag == "--tensorboard":
        expected = f"tensorboard='{target}' cannot be written (Permission denied: "
    else:
        expected = f"checkpoint directory {target} cannot hold its lock file jaxdp.lock: Per"
    assert done.stderr.startswith(f"jaxdp train: error: {expected}"), done.stderr
    assert done.stderr.count("\n") == 1
    assert "held-out accuracy" not in done.stdout  # refused before training, not after


def terminate_after(monkeypatch, lines):
    """Sends this process SIGTERM once, as the metrics log writes its ``lines``-th record.

    From inside the training loop, not from a thread polling the file: a starved
    thread on a busy machine could send it after a short run had ended.
    """
    write, sent = MetricsLog.write, []

    def write_then_terminate(self, record):
        write(self, record)
        if len(self.records) == lines and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(MetricsLog, "write", write_then_terminate)


def saved_leaves(directory):
    """The SHA-256 of every array of the newest checkpoint in ``directory``."""
    newest = max(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    meta = json.loads((directory / str(newest) / "meta" / "metadata").read_text())
    return {name: leaf["sha256"] for name, leaf in meta["leaves"].items()}


def records(path):
    """Metrics without the wall-clock throughput."""
    lines = path.read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "samples_per_s"} for line in lines]


def test_resume_takes_the_run_config_from_the_checkpoint(tmp_path, capsys, monkeypatch):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    # 1438 rows, global batch 4 x 4 x 8 = 128: 11 optimizer steps per epoch.
    flags = ["--num-devices", "4", "--accum-steps", "4", "--micro-batch-size", "8"]
    flags += ["--path", "multisteps", "--precision", "float64", "--epochs", "2"]
    flags += ["--checkpoint-every", "5", "--metrics-out", str(metrics)]
    terminate_after(monkeypatch, 3)
    assert main([*TRAIN, *flags, "--checkpoint-dir", str(ckpt)]) == 128 + signal.SIGTERM
    capsys.readouterr()
    # No flag but where the checkpoints are: everything else comes from the checkpoint.
    assert main([*TRAIN, "--checkpoint-dir", str(ckpt), "--resume"]) == 0
    out = capsys.readouterr().out
    taken = re.search(r"^taken from checkpoint (\S+) for the options not given: (.*)$", out, re.M)
    assert taken, out
    assert taken.group(2) == (
        "num_devices=4, accum_steps=4, micro_batch_size=8, epochs=2, path='multisteps', "
        f"precision='float64', checkpoint_every=5, metrics_out='{metrics}' (the others: the "
        "defaults)"
    )
    assert f"resumed from {taken.group(1)}: step " in out
    whole = TrainConfig(
        num_devices=4,
        accum_steps=4,
        micro_batch_size=8,
        epochs=2,
        path="multisteps",
        precision="float64",
        checkpoint_dir=str(tmp_path / "whole"),
        metrics_out=str(tmp_path / "whole.jsonl"),
        progress=False,
    )
    assert train(whole)["steps"] == 2 * 11  # resumed in epoch 0, across into epoch 1
    assert jaxdp.checkpoint.Checkpoints(ckpt).steps[-1] == 2 * 11
    assert saved_leaves(ckpt) == saved_leaves(tmp_path / "whole")  # bitwise
    assert records(metrics) == records(tmp_path / "whole.jsonl")


def test_resume_refuses_a_flag_the_checkpoint_cannot_continue_with(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    flags = [*TRAIN, "--num-devices", "4", "--path", "multisteps", "--checkpoint-dir", ckpt]
    assert main([*flags, "--steps", "2"]) == 0
    for flag, message in [
        (
            ["--path", "fused"],
            r"--path='fused' differs from the checkpoint's path='multisteps' \(.*/2\); a "
            r"resumed run keeps it \(the accumulation path decides the optimizer state's layout\)",
        ),
        (["--lr", "0.1"], r"--learning-rate=0.1 differs from the checkpoint's learning_rate=0.003"),
        (
            ["--shards", "2"],
            r"--shards=2 differs from the checkpoint's shards=None \(.*/2\); a resumed run "
            r"keeps it \(the shard groups decide how the parameters and optimizer state are",
        ),
    ]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            main([*TRAIN, "--checkpoint-dir", ckpt, "--resume", *flag])
        assert exit_.value.code == 2  # a usage error
        assert re.match(f"jaxdp train: error: {message}", capsys.readouterr().err)
    # A flag of a field a resume may change overrides the checkpoint's.
    assert main([*TRAIN, "--checkpoint-dir", ckpt, "--resume", "--steps", "3"]) == 0
    assert jaxdp.checkpoint.Checkpoints(ckpt).steps == [2, 3]


def test_version_names_jaxdp_and_the_installed_jax(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    jax_version = importlib.metadata.version("jax")
    assert capsys.readouterr().out == f"jaxdp {jaxdp.__version__} (jax {jax_version})\n"


def option_entries(text):
    """``(invocation, help)`` of every option in an argparse help text."""
    entries, current = [], None
    for line in text.splitlines():
        if re.match(r"  \S", line):  # a new entry: an option, or a positional argument
            current = re.split(r"\s{2,}", line.strip(), maxsplit=1) + [""]
            current = current[:2] if line.startswith("  -") else None
            if current is not None:
                entries.append(current)
        elif line.startswith("   ") and current is not None:
            current[1] = f"{current[1]} {line.strip()}".strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("command", [[], ["train"], ["parity"], ["plan"], ["launch"]])
def test_help_is_plain_text_with_every_default(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and not re.search(r":(func|class|mod|data):", text)
    entries = option_entries(text)
    assert len(entries) >= (2 if not command else 5)
    for invocation, help_text in entries:
        assert help_text, invocation
        takes_value = any(" " in alternative for alternative in invocation.split(", "))
        if takes_value:
            assert "(default: " in help_text or "required" in help_text, invocation


def test_bench_is_not_installed_and_says_where_it_runs(capsys):
    """The benchmarks live in the repository (benchmarks/), not in the package."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--quick"])
    assert exit_.value.code == 2  # as argparse's for an unknown command
    err = capsys.readouterr().err
    assert err.endswith("jaxdp: error: jaxdp bench runs from a source checkout: bin/jaxdp bench\n")


BLOCK_AND_RUN = """
import sys

class Block:
    # As if the cli extra's modules were not installed.
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Block())
import jaxdp.cli
sys.exit(jaxdp.cli.main({argv!r}))
"""


def run_without(blocked, argv):
    code = BLOCK_AND_RUN.format(blocked=sorted(blocked), argv=argv)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "argv, blocked, missing",
    [
        (["train"], {"sklearn", "tqdm", "matplotlib"}, "scikit-learn, tqdm, matplotlib"),
        (["train", "--steps", "5"], {"tqdm"}, "tqdm"),
        (["train", "--tensorboard", "tb"], {"tensorboardX"}, "tensorboardX"),
    ],
)
def test_without_the_cli_extra_one_line_names_what_is_missing(argv, blocked, missing):
    done = run_without(blocked, argv)
    assert done.returncode == 1
    assert done.stderr == (
        f"jaxdp {argv[0]}: error: needs {missing} (the command line's extra): "
        "pip install 'jaxdp[cli]'\n"
    )
    assert done.stdout == ""


def test_zero_stage_2_with_bf16_communication_trains(tmp_path, capsys):
    summary = tmp_path / "summary.json"
    flags = [*TRAIN, "--num-devices", "4", "--zero-stage", "2", "--comm-dtype", "bfloat16"]
    assert main([*flags, "--steps", "3", "--summary-out", str(summary)]) == 0
    result = json.loads(summary.read_text())
    assert result["steps"] == 3 and math.isfinite(result["final_loss"])
    out = capsys.readouterr().out
    assert (
        "zero_stage=2: optimizer state and gradient accumulator split over 4 device(s); "
        "gradients sent in bfloat16"
    ) in out


def test_plan_needs_no_cli_extra():
    done = run_without({"sklearn", "tqdm", "matplotlib"}, ["plan", "--params", "7e9"])
    assert done.returncode == 0, done.stderr
    assert "112.00 GB" in done.stdout


@pytest.mark.parametrize("skip", [True, False])
def test_a_nonfinite_step_is_reported_and_without_skipping_stops_the_run(tmp_path, capsys, skip):
    # SGD at 1e30: step 1's update leaves the weights finite (about 1e30), step 2's
    # logits overflow and its loss and gradients are NaN.
    ckpt = tmp_path / "ckpt"
    flags = [*TRAIN, "--num-devices", "2", "--accum-steps", "1", "--optimizer", "sgd"]
    flags += ["--lr", "1e30", "--steps", "5", "--checkpoint-dir", str(ckpt)]
    flags += ["--checkpoint-every", "1"] + ([] if skip else ["--no-skip-nonfinite"])
    with pytest.raises(SystemExit) as exit_:
        main(flags)
    assert exit_.value.code == 1
    out, err = capsys.readouterr()
    if skip:  # each skipped update is said, until max_consecutive_skips ends the run
        for n in range(1, 11):
            assert (
                "optimizer step 2 (epoch 0): non-finite loss=nan, grad_norm=nan; update "
                f"skipped ({n} in a row; max_consecutive_skips=10 ends the run)"
            ) in out
    else:
        assert err == (
            "jaxdp train: error: optimizer step 2 (epoch 0) had a non-finite loss=nan, "
            "grad_norm=nan, and with skip_nonfinite off (--no-skip-nonfinite) its update made "
            "the parameters non-finite: stopped there, nothing saved after it; the newest "
            f"checkpoint is {ckpt / '1'}. Resume with skipping on, or a lower learning rate\n"
        )
    assert jaxdp.checkpoint.Checkpoints(ckpt).steps == [1]


HOLD_LOCK = """
import sys
from jaxdp.checkpoint._lock import directory_lock
with directory_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_checkpoint_directory_in_use_is_refused_naming_its_owner(tmp_path, capsys):
    """A new run and a ``--resume`` alike, while one process holds the lock."""
    ckpt = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(ckpt)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ends = []
    try:
        assert holder.stdout.readline() == "held\n"
        for resume in ([], ["--resume"]):
            with pytest.raises(SystemExit) as exit_:
                main([*TRAIN, "--checkpoint-dir", str(ckpt), *resume])
            ends.append((resume, exit_.value.code, capsys.readouterr().err))
    finally:
        holder.communicate("")  # ends it
    assert len(ends) == 2
    for resume, code, err in ends:
        assert code == 2, resume
        assert err.startswith(
            f"jaxdp train: error: checkpoint directory {ckpt} is in use by another run: host "
            f"{socket.gethostname()}, pid {holder.pid} (-c {ckpt}, since "
        ), (resume, err)
        assert err.endswith(
            f") holds {ckpt / 'jaxdp.lock'}. Wait for it to end, or choose another directory "
            "(two runs in one directory would remove each other's unfinished checkpoints)\n"
        ), (resume, err)


# Fills the file system under a checkpoint directory once a checkpoint is there, so
# that a later one cannot be written: a small tmpfs in a mount namespace of its own
# (no privileges needed where user namespaces are allowed), else a file size limit
# (RLIMIT_FSIZE, set on the running process: EFBIG instead of ENOSPC).
FILL_THE_DISK = """
import json, os, pathlib, resource, subprocess, sys, time
mode, disk = sys.argv[1], pathlib.Path(sys.argv[2])
if mode == "tmpfs":
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)
ckpt = disk / "ckpt"
train = subprocess.Popen(
    [sys.executable, "-m", "jaxdp", "train", "--cpu-devices", "1", "--accum-steps", "1",
     "--steps", "300", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt),
     "--no-progress"],
    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
while not (ckpt / "2").exists() and train.poll() is None:  # renamed into place: complete
    time.sleep(0.02)
if mode == "tmpfs":
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError:
        pass
else:
    resource.prlimit(train.pid, resource.RLIMIT_FSIZE, (4096, 4096))
out, err = train.communicate(timeout=600)
steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
print(json.dumps({"status": train.returncode, "stdout": out, "stderr": err, "steps": steps}))
"""


def test_a_full_disk_while_checkpointing_is_one_line_naming_the_newest_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    namespace = ["unshare", "--user", "--map-root-user", "--mount"]
    probe = f"mount -t tmpfs -o size=1m tmpfs {disk}"
    tmpfs = shutil.which("unshare") and subprocess.run([*namespace, "sh", "-c", probe]).returncode
    command = [sys.executable, "-c", FILL_THE_DISK, "tmpfs" if tmpfs == 0 else "fsize", str(disk)]
    done = subprocess.run(
        [*namespace, *command] if tmpfs == 0 else command,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout)
    ckpt, newest = disk / "ckpt", run["steps"][-1]
    cause = "No space left on device (ENOSPC)" if tmpfs == 0 else "File too large (EFBIG)"
    assert run["status"] == 1
    # One line: the checkpoint, the cause, the newest valid checkpoint (kept); not
    # orbax's threads' tracebacks nor tensorstore's on a closed event loop.
    assert re.fullmatch(
        rf"jaxdp train: error: checkpoint {ckpt}/(\d+) could not be written \(no room left: "
        rf"{re.escape(cause)}\); the newest valid checkpoint is {ckpt}/{newest}, kept; the "
        r"partial write is removed by a later save there\n",
        run["stderr"],
    ), run["stderr"][-3000:]
    assert f"checkpoint {ckpt}/{newest}: step {newest}" in run["stdout"]


def write_blobs(path, n=400, features=6, classes=3):
    """Three well-separated Gaussian blobs: a user's own classification data."""
    rng = np.random.default_rng(1)
    y = rng.integers(0, classes, size=n)
    centers = rng.normal(scale=4.0, size=(classes, features))
    x = centers[y] + rng.normal(size=(n, features))
    np.savez(path, x=x.astype(np.float32), y=y)
    return x, y


def test_train_on_a_users_npz_sizes_the_model_from_it(tmp_path, capsys):
    data = tmp_path / "blobs.npz"
    write_blobs(data)
    summary, metrics, board = tmp_path / "summary.json", tmp_path / "m.jsonl", tmp_path / "tb"
    flags = ["--data", str(data), "--num-devices", "2", "--epochs", "5", "--lr", "3e-2"]
    flags += ["--summary-out", str(summary), "--metrics-out", str(metrics)]
    assert (
        main([*TRAIN, *flags, "--tensorboard", str(board), "--plot", str(tmp_path / "p.png")]) == 0
    )
    out = capsys.readouterr().out
    assert f"jaxdp train: {data} MLP (float32) on 2 cpu device(s), 320 train / 80 held-out" in out
    accuracy = json.loads(summary.read_text())["test_accuracy"]
    assert accuracy > 0.95  # separable: near 1
    # Held-out accuracy (over the mesh) and the learning rate at every epoch's end.
    # 320 rows, global batch 2 x 2 x 16 = 64: 5 steps per epoch.
    scored = [(r["step"], r["test_accuracy"]) for r in records(metrics) if "test_accuracy" in r]
    assert [step for step, _ in scored] == [5, 10, 15, 20, 25]
    assert scored[-1][1] == accuracy and all(a in np.arange(81) / 80 for _, a in scored)
    assert "epoch 4 done: step 25 loss " in out
    assert f", held-out accuracy {accuracy:.2%}, learning rate 0.03\n" in out
    # The event files read back: every step's loss, every epoch's held-out accuracy.
    scalars = tensorboard_scalars(board)
    f32 = np.float32
    assert scalars["held_out/accuracy"] == [(step, f32(a)) for step, a in scored]
    assert scalars["train/loss"] == [(r["step"], f32(r["loss"])) for r in records(metrics)]
    assert {s for s, _ in scalars["train/learning_rate"]} == set(range(1, 26))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def tensorboard_scalars(directory):
    """``{tag: [(step, value)]}`` of the event files in ``directory`` (TFRecord framing:
    length, its CRC, the serialized Event, its CRC)."""
    from tensorboardX.proto import event_pb2

    found = {}
    for file in sorted(directory.glob("events.out.tfevents.*")):
        data, at = file.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


def test_the_plot_shows_loss_raw_and_smoothed_accuracy_and_rate_under_a_whole_title(tmp_path):
    rows = [{"step": s, "loss": 2.0 / s, "learning_rate": 1e-3} for s in range(1, 31)]
    for r in rows[9::10]:
        r["test_accuracy"] = r["step"] / 40
    sizes = jaxdp.batch_sizes(num_devices=4, accum_steps=2, micro_batch_size=16)
    title = "jaxdp train: " + sizes.describe()
    fig = plot_training(rows, str(tmp_path / "p.png"), title=title)
    top, bottom, rate = fig.axes
    assert [line.get_label() for line in top.get_lines()] == ["raw", "smoothed (EMA 0.9)"]
    assert list(bottom.get_lines()[0].get_xdata()) == [10, 20, 30]
    assert list(rate.get_lines()[0].get_ydata()) == [1e-3] * 30
    shown = fig._suptitle
    assert shown.get_text().replace("\n", " ") == title
    box, page = shown.get_window_extent(), fig.bbox  # as drawn by savefig
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1, (box, page)


@pytest.mark.parametrize(
    "arrays,message",
    [
        (None, "data='{path}' does not exist"),
        ({"x": np.zeros((10, 2))}, "data='{path}' has arrays ['x']; it needs x (features or "),
        (
            {"x": np.zeros((10, 2)), "y": np.zeros(9, int)},
            "data='{path}': x has shape (10, 2) and y (9,)",
        ),
        ({"x": np.zeros((10, 2)), "y": np.zeros(10)}, "data='{path}': y must hold class indices"),
    ],
)
def test_bad_data_files_are_usage_errors_before_training(tmp_path, capsys, arrays, message):
    path = tmp_path / "mine.npz"
    if arrays is not None:
        np.savez(path, **arrays)
    with pytest.raises(SystemExit) as exit_:
        main([*TRAIN, "--data", str(path), "--steps", "1"])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"jaxdp train: error: {message.format(path=path)}")
    assert "held-out accuracy" not in out


def test_a_data_directory_without_y_npy_is_a_usage_error(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.zeros((10, 2), np.float32))
    with pytest.raises(SystemExit) as exit_:
        main([*TRAIN, "--data", str(tmp_path), "--steps", "1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        f"jaxdp train: error: data='{tmp_path}' is a directory without ['y.npy']; it needs "
        "x.npy (features or images) and y.npy (integer labels)\n"
    )


def test_kill_9_mid_run_then_resume_trains_the_same_rows_as_an_uninterrupted_run(tmp_path):
    """kill -9 at a random step of a run on a directory of .npy (x read as a memmap),
    then --resume: the loader continues at the checkpoint's rows, no position given."""
    data = tmp_path / "blobs"
    data.mkdir()
    x, y = write_blobs(tmp_path / "blobs.npz")
    np.save(data / "x.npy", x.astype(np.float32))
    np.save(data / "y.npy", y)
    # 320 train rows, global batch 2 x 2 x 8 = 32: 10 steps per epoch.
    flags = ["--data", str(data), "--num-devices", "2", "--micro-batch-size", "8", "--hidden", "8"]
    flags += ["--epochs", "1000", "--checkpoint-every", "2"]
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    out = ["--checkpoint-dir", str(ckpt), "--metrics-out", str(metrics)]
    killed_at = np.random.default_rng().integers(3, 15)  # after this many updates
    child = subprocess.Popen(
        [sys.executable, "-m", "jaxdp", "train", "--cpu-devices", "2", *flags, *out],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    while child.poll() is None and not (
        metrics.exists() and len(metrics.read_text().splitlines()) >= killed_at
    ):
        time.sleep(0.01)
    child.kill()  # SIGKILL: no handler runs, no checkpoint at the stop
    assert child.wait(timeout=60) == -signal.SIGKILL, child.stderr.read()[-2000:]
    newest = jaxdp.checkpoint.Checkpoints(ckpt).steps[-1]
    assert newest < 30, f"killed after {killed_at} updates, too late: checkpoint {newest}"
    assert main([*TRAIN, "--checkpoint-dir", str(ckpt), "--resume", "--steps", "30"]) == 0
    whole = ["--checkpoint-dir", str(tmp_path / "whole"), "--metrics-out", str(tmp_path / "w")]
    assert main([*TRAIN, *flags, *whole, "--steps", "30"]) == 0
    # Every step's loss and gradient norm, bitwise, and the final weights.
    assert records(metrics) == records(tmp_path / "w"), f"killed after {killed_at} updates"
    assert len(records(metrics)) == 30
    assert saved_leaves(ckpt) == saved_leaves(tmp_path / "whole")


def test_resume_drops_a_metrics_line_torn_by_a_kill(tmp_path):
    """A kill in the middle of a record's write leaves its line cut short; that record is
    of a step after the newest checkpoint (a step's record is written before its
    checkpoint), so a resume drops it with the other later records."""
    path = tmp_path / "m.jsonl"
    whole = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in whole) + '{"step": 4, "lo')
    with MetricsLog(str(path), resume_step=2) as log:
        assert log.records == whole[:2]
        log.write({"step": 3, "loss": 0.5})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        *whole[:2],
        {"step": 3, "loss": 0.5},
    ]


def test_sigterm_ends_a_train_process_with_143_and_a_bare_resume_continues_on_its_devices(
    tmp_path,
):
    """A scheduler's SIGTERM to ``jaxdp train`` as a process of its own (not ``main()`` in
    this process, not under the launcher): it exits 143 itself (a death by the signal
    would read -15 here), with a checkpoint of the step it reports, from which
    ``--resume`` continues (issue 23.1; the status over 20 runs of each way to end:
    benchmarks/studies/exit_status.py). The run had ``--cpu-devices 2``; the resume gives
    no device count, and takes 2 from the checkpoint, not the default 4 (which the global
    batch check refused: issue 23.7). In fresh processes: this one's JAX has its 8
    devices already."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    command = [sys.executable, "-m", "jaxdp", "train", "--no-progress"]
    command += ["--checkpoint-dir", str(ckpt), "--metrics-out", str(metrics)]
    child = subprocess.Popen(
        [*command, "--cpu-devices", "2", "--steps", "100000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert child.poll() is None, child.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "no metrics record"
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 128 + signal.SIGTERM, err[-2000:]
    stop = re.search(
        r"^jaxdp train: process 0 stopped at optimizer step (\d+) \(.*\); checkpoint (\S+)$",
        err,
        re.M,
    )
    assert stop, err[-2000:]
    step = int(stop.group(1))
    assert stop.group(2) == str(ckpt / str(step))
    assert jaxdp.checkpoint.Checkpoints(ckpt).steps[-1] == step
    assert [r["step"] for r in records(metrics)] == list(range(1, step + 1))
    done = subprocess.run(
        [*command, "--resume", "--steps", str(step + 2)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from {ckpt / str(step)}: step {step}" in done.stdout
    taken = re.search(
        r"^taken from checkpoint \S+ for the options not given: (.*)$", done.stdout, re.M
    )
    assert taken, done.stdout
    assert re.search(r"\bcpu_devices=2\b", taken.group(1)), taken.group(1)
    assert not re.search(r"\bsteps=", taken.group(1)), taken.group(1)  # --steps was given
    assert "batch: global_batch_size=64 = num_devices=2 x" in done.stdout
    assert [r["step"] for r in records(metrics)] == list(range(1, step + 3))
    assert jaxdp.checkpoint.Checkpoints(ckpt).steps[-1] == step + 2


def test_resume_on_a_directory_without_checkpoints_starts_fresh_and_says_so(tmp_path, capsys):
    """A scheduler's requeue script runs one command, ``--resume``, every time (issue 23.7);
    a directory whose checkpoints are all unreadable is still refused, never restarted."""
    ckpt = tmp_path / "ckpt"
    flags = [*TRAIN, "--num-devices", "4", "--checkpoint-dir", str(ckpt), "--resume"]
    assert main([*flags, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert f"--resume: no checkpoint in {ckpt} yet; starting a fresh run" in out
    assert jaxdp.checkpoint.Checkpoints(ckpt).steps == [2]
    assert main([*flags, "--steps", "3"]) == 0
    assert f"resumed from {ckpt / '2'}: step 2" in capsys.readouterr().out
    (ckpt / "3" / "meta" / "metadata").write_text("{}")
    (ckpt / "2" / "meta" / "metadata").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        main([*flags, "--steps", "4"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(
        f"jaxdp train: error: no readable checkpoint in {ckpt}"
    )

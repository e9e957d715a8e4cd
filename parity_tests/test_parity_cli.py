"""`jaxdp parity` as docs/parity.md and docs/check-your-port.md show it, and the report's
verdict."""

import copy
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import port_models
import pytest
import token_lm

from jaxdp.cli import main
from jaxdp.parity import ParityConfig, Trajectory, compare, format_parity, plot_parity


def test_parity_command_prints_the_comparison():
    # As `python -m jaxdp` (tests/test_cli.py runs the script `jaxdp`): its DDP ranks
    # import the package's __main__.py again, which must not run the command once more.
    out = subprocess.run(
        [sys.executable, "-m", "jaxdp", "parity", "--model", "mlp", "--num-devices", "2"]
        + ["--accum-steps", "2"]
        + ["--steps", "10"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # Nothing a user cannot act on: torch's broadcast_buffers FutureWarning, one per rank.
    assert "is deprecated" not in out.stderr, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(
        "parity: mlp, adamw, float64, jaxdp fused/shard_map vs torch_ref DDP"
    )
    assert "num_devices=2 x accum_steps=2 x micro_batch_size=4" in lines[0]
    assert step_rows(lines) == [str(i) for i in range(1, 11)]
    assert lines[-1] == "PASS: every step within tolerance"


def step_rows(lines):
    """The step numbers of the report's first table (the one per step)."""
    start = lines.index(next(line for line in lines if line.startswith("step")))
    end = lines.index("", start)
    return [line.split()[0] for line in lines[start + 1 : end]]


def test_parity_command_on_your_own_models(tmp_path, monkeypatch, capsys):
    """The command docs/check-your-port.md shows, on the ResCNN pair of port_models.py: the
    command's own code (flags, the models loaded from a file, the locator, the plot, the
    report and the exit status) in this process, whose backend has 8 devices already (the
    command's num_devices=1 takes the first); the command in a fresh process of its own
    device count is test_parity_command_prints_the_comparison."""
    x, y = port_models.images()
    np.savez(tmp_path / "images.npz", x=x, y=y)
    models = pathlib.Path(__file__).parent / "port_models.py"
    monkeypatch.setattr("jaxdp._mesh.emulate_cpu_devices", lambda num_devices: None)
    status = main(
        ["parity", "--torch-model", f"{models}:TorchResCNN"]
        + ["--jax-model", f"{models}:JaxResCNN", "--data", str(tmp_path / "images.npz")]
        + ["--num-devices", "1", "--accum-steps", "4", "--micro-batch-size", "2"]
        + ["--steps", "3", "--locate", "--plot", str(tmp_path / "parity.png")]
    )
    out = capsys.readouterr()
    assert status == 0, out.out + out.err
    lines = out.out.splitlines()
    assert lines[0].startswith("parity: TorchResCNN vs JaxResCNN, adamw, float64"), lines[0]
    assert step_rows(lines) == ["1", "2", "3"]
    assert "max relative difference per step and parameter group:" in lines
    assert any(line.startswith("divergence locator: optimizer step") for line in lines)
    assert lines[-3:] == ["", "PASS: every step within tolerance", f"plot: {tmp_path}/parity.png"]
    assert (tmp_path / "parity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_names_the_first_step_beyond_tolerance():
    config = ParityConfig(steps=3)
    theirs = Trajectory([{"w": np.ones(3)} for _ in range(3)], [1.0, 1.0, 1.0])
    ours = copy.deepcopy(theirs)
    ours.states[1]["w"][2] += 1e-9  # beyond 1e-12 + 1e-10 * 1
    ours.states[2]["w"][2] += 1e-11  # within
    report = compare(config, ours, theirs)
    assert report.first_failure == 2
    np.testing.assert_allclose(report.max_abs[1]["w"], 1e-9, rtol=1e-6)
    text = format_parity(report)
    assert "<- first beyond tolerance" in text.splitlines()[5]
    assert text.endswith("FAIL: step 2 is the first beyond tolerance")


def test_plot_parity_writes_a_png(tmp_path):
    theirs = Trajectory([{"w": np.ones(3)} for _ in range(2)], [1.0, 1.0])
    ours = copy.deepcopy(theirs)
    ours.states[1]["w"][0] += 1e-9
    plot_parity(compare(ParityConfig(steps=2), ours, theirs), tmp_path / "parity.png")
    assert (tmp_path / "parity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_step_counts_must_agree():
    config = ParityConfig(steps=2)
    run = Trajectory([{"w": np.ones(1)}] * 2, [0.0, 0.0])
    short = Trajectory([{"w": np.ones(1)}], [0.0])
    with pytest.raises(ValueError, match="jaxdp made 2 optimizer steps, torch_ref 1"):
        compare(config, run, short)


@pytest.mark.parametrize(
    ("flags", "parallel", "torch_side", "header"),
    [
        (["--zero-stage", "3"], (3, None), (False, True, None), "zero_stage=3 vs torch_ref FSDP2"),
        (
            ["--zero-stage", "3", "--shards", "2"],
            (3, 2),
            (False, True, 2),
            "zero_stage=3, shards=2 vs torch_ref HSDP (2 x 2)",
        ),
        (
            ["--zero-stage", "2"],
            (2, None),
            (True, False, None),
            "zero_stage=2 vs torch_ref DDP + ZeroRedundancyOptimizer",
        ),
    ],
)
def test_zero_stage_and_shards_choose_both_sides(
    flags, parallel, torch_side, header, monkeypatch, capsys
):
    """``--zero-stage``/``--shards`` set jaxdp's Parallel and torch_ref's counterpart from
    one ParityConfig (stage 3: FSDP2; with shards: HSDP; 1 and 2: ZeroRedundancyOptimizer),
    and the report's first line names both. The trajectories' equality on every cell of
    the grid is parity_tests/test_parity_fsdp.py's and test_parity_zero.py's; here the
    command's wiring, without training."""
    from jaxdp.parity._runner import torch_config, with_groups

    seen = []

    def recorded(config):
        seen.append(config)
        n = config.steps
        empty = Trajectory([{"w": np.zeros(1)}] * n, [0.0] * n)
        return compare(config, empty, empty, rtol=1e-10)

    monkeypatch.setattr("jaxdp.parity.run_parity", recorded)
    monkeypatch.setattr("jaxdp._mesh.emulate_cpu_devices", lambda num_devices: None)
    argv = ["parity", "--model", "stack", "--num-devices", "4", "--steps", "1", *flags]
    assert main(argv) == 0
    (config,) = seen
    step_parallel = with_groups(
        {}, strategy=config.strategy, zero_stage=config.zero_stage, shards=config.shards
    )["parallel"]
    assert (step_parallel.zero_stage, step_parallel.shards) == parallel
    ours = torch_config(config)
    assert (ours.zero, ours.fsdp, ours.shards) == torch_side
    assert f"jaxdp fused/shard_map {header};" in capsys.readouterr().out.splitlines()[0]


def test_tp_sets_the_model_axis_on_both_sides(monkeypatch):
    """``--tp 2``: jaxdp's ParityConfig(tp=2) (a (data, model) mesh, the model's plan),
    torch_ref's tp ranks per data rank, and tp x num-devices devices emulated; the
    trajectories' equality is test_parity_tp.py's."""
    from jaxdp.parity._runner import torch_config

    seen, devices = [], []

    def recorded(config):
        seen.append(config)
        empty = Trajectory([{"w": np.zeros(1)}], [0.0])
        return compare(config, empty, empty, rtol=1e-10)

    monkeypatch.setattr("jaxdp.parity.run_parity", recorded)
    monkeypatch.setattr("jaxdp._mesh.emulate_cpu_devices", devices.append)
    argv = ["parity", "--model", "stack", "--num-devices", "2", "--steps", "1", "--tp", "2"]
    assert main([*argv, "--zero-stage", "2"]) == 0
    (config,) = seen
    ours = torch_config(config)
    assert (config.tp, ours.tp, ours.num_devices, ours.fsdp, ours.zero) == (2, 2, 4, True, False)
    assert devices == [4]


def test_zero_stage_flags_are_checked_before_either_side_trains(monkeypatch, capsys):
    """Each a usage error before anything trains: one line, exit status 2 (issue 44 item 6:
    pmap at stage 3, shards=1 and cuda without a GPU crashed with a traceback, exit 1, after
    jaxdp had trained)."""
    monkeypatch.setattr("jaxdp.parity.run_parity", lambda config: pytest.fail("it trained"))
    monkeypatch.setattr("jaxdp.parity.compare_models", lambda *a, **k: pytest.fail("it trained"))
    monkeypatch.setattr("jaxdp._mesh.emulate_cpu_devices", lambda num_devices: None)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)  # also on a GPU machine
    port = ["--torch-model", "m:T", "--jax-model", "m:J", "--data", "d.npz"]
    for flags, said in [
        (["--zero-stage", "2", "--shards", "2"], "shards=2 needs zero_stage=3"),
        (["--zero-stage", "3", "--shards", "3"], "shards=3 must divide num_devices=4"),
        (["--zero-stage", "3", "--strategy", "pmap"], "zero_stage=3 needs strategy='shard_map'"),
        (["--zero-stage", "3", "--shards", "1"], "shards=1 must be None (one shard group"),
        (["--zero-stage", "3", "--remat", "some"], "remat='some' must be 'dots', 'full' or the"),
        (["--remat", "full"], "remat='full' needs zero_stage=3"),
        (["--tp", "0"], "tp=0 must be a positive integer"),
        (["--torch-device", "cuda"], "torch_device='cuda' needs one GPU per rank: num_devices=4"),
        ([*port, "--torch-device", "cuda"], "torch_device='cuda' needs one GPU per rank"),
    ]:
        model = [] if "--torch-model" in flags else ["--model", "stack"]
        with pytest.raises(SystemExit) as exit_:
            main(["parity", *model, "--num-devices", "4", *flags])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"jaxdp parity: error: {said}") and err.count("\n") == 1, err


def test_a_sum_and_count_loss_without_weighted_is_one_line_before_torch_trains(
    tmp_path, monkeypatch, capsys
):
    """Issue 50, item 7: a (loss_sum, count) loss under the default loss_reduction='mean'
    ran torch_ref for 77 s, then a 32-line traceback (a tuple divided by accum_steps); it is
    a usage error when jaxdp's step first traces the loss, before either side trains."""
    x, y = token_lm.data()
    np.savez(tmp_path / "tokens.npz", x=x, y=y)
    monkeypatch.setattr("jaxdp._mesh.emulate_cpu_devices", lambda num_devices: None)
    monkeypatch.setattr(
        "jaxdp.parity._compare_models.run_torch_port", lambda port: pytest.fail("torch trained")
    )
    lm = pathlib.Path(__file__).parent / "token_lm.py"
    with pytest.raises(SystemExit) as exit_:
        main(
            ["parity", "--torch-model", f"{lm}:TorchLM", "--jax-model", f"{lm}:JaxLM"]
            + ["--data", str(tmp_path / "tokens.npz")]
            + ["--loss", f"{lm}:torch_token_loss,jax_token_loss"]
            + ["--num-devices", "1", "--micro-batch-size", "3", "--steps", "2"]
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(
        "jaxdp parity: error: loss jax_token_loss returns a tuple of 2 values, and "
        "loss_reduction='mean' takes one scalar"
    ), err
    assert "--loss-reduction weighted" in err


def test_parity_command_on_a_weighted_scheduled_script_in_files_of_its_own(
    tmp_path, monkeypatch, capsys
):
    """A team's files as they lie (the port imports the file beside it, without PYTHONPATH):
    ``--loss-reduction weighted`` and ``--schedule`` compared at float64's tolerance."""
    shutil.copy(pathlib.Path(__file__).parent / "token_lm.py", tmp_path / "team_lm.py")
    (tmp_path / "team_port.py").write_text("from team_lm import JaxLM as Port\n")
    x, y = token_lm.data()
    np.savez(tmp_path / "tokens.npz", x=x, y=y)
    monkeypatch.setattr("jaxdp._mesh.emulate_cpu_devices", lambda num_devices: None)
    lm = tmp_path / "team_lm.py"
    status = main(
        ["parity", "--torch-model", f"{lm}:TorchLM", "--jax-model", f"{tmp_path}/team_port.py:Port"]
        + ["--data", str(tmp_path / "tokens.npz"), "--loss-reduction", "weighted"]
        + ["--loss", f"{lm}:torch_token_loss,jax_token_loss"]
        + ["--schedule", f"{lm}:torch_schedule,optax_schedule"]
        + ["--num-devices", "1", "--accum-steps", "2", "--micro-batch-size", "3", "--steps", "4"]
    )
    out = capsys.readouterr()
    assert status == 0, out.out + out.err
    assert out.out.splitlines()[-1] == "PASS: every step within tolerance"
    assert str(tmp_path) not in sys.path  # the file's folder was on it while it ran only


def test_parity_command_names_the_kind_of_a_planted_bug(tmp_path, monkeypatch, capsys):
    """The team's port with its optax schedule a step ahead of torch's LambdaLR: the report
    of ``jaxdp parity`` ends with the locator's finding, the learning rate, its kind."""
    shutil.copy(pathlib.Path(__file__).parent / "token_lm.py", tmp_path / "team_lm.py")
    (tmp_path / "team_port.py").write_text(
        "from team_lm import JaxLM as Port, jax_token_loss, optax_schedule\n\n\n"
        "def ahead(count):\n    return optax_schedule(count + 1)\n"
    )
    x, y = token_lm.data()
    np.savez(tmp_path / "tokens.npz", x=x, y=y)
    monkeypatch.setattr("jaxdp._mesh.emulate_cpu_devices", lambda num_devices: None)
    lm, port = tmp_path / "team_lm.py", tmp_path / "team_port.py"
    status = main(
        ["parity", "--torch-model", f"{lm}:TorchLM", "--jax-model", f"{port}:Port"]
        + ["--data", str(tmp_path / "tokens.npz"), "--loss-reduction", "weighted"]
        + ["--loss", f"{lm}:torch_token_loss,jax_token_loss"]
        + ["--schedule", f"{lm}:torch_schedule,{port}:ahead"]
        + ["--num-devices", "1", "--accum-steps", "2", "--micro-batch-size", "3", "--steps", "2"]
    )
    out = capsys.readouterr().out
    assert status == 1, out
    assert "learning rate (step 1)" in out and "DIFFERS" in out, out
    assert "\nkind: schedule\n" in out, out
    assert out.splitlines()[-1] == "FAIL: step 1 is the first beyond tolerance"


def test_optimizer_beyond_the_presets_through_a_spec(tmp_path, monkeypatch, capsys):
    """``--optimizer MODULE:ATTR`` of an OptimizerSpec (any rates; parameter groups for
    one's own models), checked before either side trains; the run's wiring, not training."""
    (tmp_path / "specs.py").write_text(
        "from jaxdp.parity import OptimizerSpec, ParamGroup\n"
        "BETA2 = OptimizerSpec('adamw', 3e-3, b2=0.95, weight_decay=0.1)\n"
        "GROUPED = OptimizerSpec('adamw', 3e-3, groups=(ParamGroup(('fc1.bias',)),))\n"
        "NOT_A_SPEC = 3\n"
    )
    seen = []

    def recorded(config):
        seen.append(config)
        empty = Trajectory([{"w": np.zeros(1)}], [0.0])
        return compare(config, empty, empty)

    monkeypatch.setattr("jaxdp.parity.run_parity", recorded)
    monkeypatch.setattr("jaxdp._mesh.emulate_cpu_devices", lambda num_devices: None)
    argv = ["parity", "--model", "mlp", "--num-devices", "1", "--steps", "1", "--optimizer"]
    assert main([*argv, f"{tmp_path}/specs.py:BETA2"]) == 0
    assert seen[0].optimizer.b2 == 0.95 and seen[0].optimizer.weight_decay == 0.1
    assert "parity: mlp, adamw, float64" in capsys.readouterr().out
    for spec, said in [
        ("nope", "--optimizer 'nope' must be one of ['adamw', 'adamw_clip', 'sgd_momentum'"),
        (f"{tmp_path}/specs.py:NOT_A_SPEC", "is 'int', not an OptimizerSpec"),
        (f"{tmp_path}/specs.py:GROUPED", "optimizer.groups name torch's parameters, and the"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main([*argv, spec])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1, err
        assert said in err, err
    assert len(seen) == 1

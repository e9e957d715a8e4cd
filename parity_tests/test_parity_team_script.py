"""A team's own torch DDP + accumulation script against its JAX port (issue 51, item 2):
team_ddp_script.py (its own loop, ``no_sync``, AdamW with two parameter groups, a warm-up
LambdaLR, the clip, float64) records itself with ``torch_ref.Recorder`` under torchrun on
2 gloo ranks, once for this file, by ``jaxdp parity --torch-script``; the record is then
compared with the port (team_jax_port.py) by ``compare_recorded``, torch_ref's loop unused."""

import contextlib
import io
import pathlib

import numpy as np
import pytest
import team_ddp_script as team
import team_jax_port
import torch

import torch_ref
from jaxdp.cli import main
from jaxdp.parity import (
    RTOL,
    OptimizerSpec,
    ParamGroup,
    compare_models,
    compare_recorded,
    format_parity,
)
from jaxdp.parity._locate import STAGES

# One xdist worker runs the file, so the script is recorded (torchrun, ~20 s) once.
pytestmark = pytest.mark.xdist_group("team_script")

HERE = pathlib.Path(__file__).parent
SCRIPT = HERE / "team_ddp_script.py"
PORT_FLAGS = [
    "--torch-model",
    f"{SCRIPT}:Net",
    "--jax-model",
    f"{HERE / 'team_jax_port.py'}:JaxNet",
    "--schedule",
    f"{HERE / 'team_jax_port.py'}:schedule",
]


def run_command(argv):
    """``jaxdp parity ARGV`` in this process (its backend has 8 devices already: the
    command's 2 take the first two): ``(status, stdout)``."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr("jaxdp._mesh.emulate_cpu_devices", lambda num_devices: None)
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code
    return status, out.getvalue()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The script recorded and compared by the command, once: ``(status, stdout, record
    path)``; the port's optimizer is optax_like_torch of the recorded spec's groups."""
    path = tmp_path_factory.mktemp("team") / "record.pkl"
    argv = ["parity", "--torch-script", str(SCRIPT), "--torch-record", str(path)]
    status, out = run_command(argv + ["--num-devices", "2", *PORT_FLAGS])
    return status, out, path


def test_the_command_records_the_script_and_its_port_trains_like_it(recorded):
    status, out, _ = recorded
    lines = out.splitlines()
    assert status == 0, out
    assert lines[0] == f"recording: torchrun --nproc-per-node 2 {SCRIPT}", lines[0]
    assert lines[1].startswith("parity: Net vs JaxNet, adamw (2 parameter groups), float64"), out
    assert "jaxdp fused/shard_map vs its torch script's record; batch" in lines[1], out
    assert "num_devices=2 x accum_steps=2 x micro_batch_size=4" in lines[1], out
    assert lines[-1] == "PASS: every step within tolerance", out


def test_the_record_holds_what_the_script_trained_in_its_order(recorded):
    record = torch_ref.load_record(recorded[2])
    w, k, b = record.num_devices, record.accum_steps, record.micro_batch_size
    assert (w, k, b, record.dtype, len(record.states)) == (2, 2, 4, "float64", team.STEPS)
    names = ("fc1.bias", "norm.weight", "norm.bias", "fc2.bias")
    (group,) = record.optimizer.groups
    assert (group.params, group.learning_rate, group.weight_decay) == (names, 2 * team.LR, 0.0)
    assert (record.optimizer.weight_decay, record.optimizer.max_grad_norm) == (0.1, 1.0)
    warmup = [team.LR * team.warmup(i) for i in range(team.STEPS)]
    np.testing.assert_allclose(record.rates, [[r, 2 * r] for r in warmup], rtol=1e-15)
    # Every rank's micro-batches, rank-major, in its DistributedSampler's order (seed 7),
    # across the epoch boundary after step 3.
    x, _ = team.data()
    steps_per_epoch = len(x) // w // b // k
    for s, (xs, _) in enumerate(record.batches):
        epoch, i = divmod(s, steps_per_epoch)
        rows = []
        for rank in range(w):
            sampler = torch.utils.data.DistributedSampler(
                range(len(x)), num_replicas=w, rank=rank, shuffle=True, seed=7
            )
            sampler.set_epoch(epoch)
            rows += list(sampler)[i * k * b : (i + 1) * k * b]
        np.testing.assert_array_equal(xs, x[rows])
    torch.manual_seed(0)
    start = team.Net().double().state_dict()
    assert all(np.array_equal(record.initial[n], t.numpy()) for n, t in start.items())


def test_the_teams_own_optax_groups_train_like_its_script(recorded):
    report = compare_recorded(
        recorded[2], team.Net, team_jax_port.JaxNet, jax_optimizer=team_jax_port.team_optimizer()
    )
    assert report.passed, format_parity(report)
    assert report.rtol == RTOL["float64"] == 1e-10  # float64's "torch_trajectory" row


def test_weight_decay_on_the_bias_group_is_located_with_its_kind(recorded):
    planted = team_jax_port.team_optimizer(rest_weight_decay=team.WEIGHT_DECAY)
    report = compare_recorded(recorded[2], team.Net, team_jax_port.JaxNet, jax_optimizer=planted)
    found, text = report.divergence, format_parity(report)
    assert report.first_failure == 1 and found is not None, text
    assert (found.step, found.stage, found.kind) == (1, "optimizer update", "weight decay or mask")
    # norm.bias starts at 0: decaying it changes nothing.
    assert sorted(found.names) == ["fc1.bias", "fc2.bias", "norm.scale"], text
    assert [s.stage for s in found.stages] == [s for s in STAGES if s != "learning rate"], text
    # Both groups' moments compared (multi_transform keeps an Adam state per group).
    (moments,) = [s for s in found.stages if s.stage == "optimizer moments"]
    assert {"fc1.kernel (exp_avg)", "fc1.bias (exp_avg)", "norm.scale (exp_avg_sq)"} <= set(
        moments.max_abs
    ), text
    assert "the port decays them by weight_decay 0.1, torch's parameter group by 0" in text


def test_a_record_gives_the_layout_and_the_optimizer(recorded, capsys):
    argv = ["parity", "--torch-record", str(recorded[2]), *PORT_FLAGS]
    status, _ = run_command([*argv, "--accum-steps", "4", "--optimizer", "sgd_momentum"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(
        "jaxdp parity: error: --accum-steps, --optimizer: the record gives these"
    ), err


def test_compare_models_trains_torch_ref_with_the_same_two_groups():
    """The spec's groups, in torch's names, on both sides of compare_models (torch_ref's
    loop in this process, one device): the port's optimizer groups the leaves the weight
    map fills from them."""
    spec = OptimizerSpec(
        "adamw",
        team.LR,
        weight_decay=team.WEIGHT_DECAY,
        groups=(
            ParamGroup(("fc1.bias", "norm.weight", "norm.bias", "fc2.bias"), 2 * team.LR, 0.0),
        ),
    )
    report = compare_models(
        team.Net, team_jax_port.JaxNet, team.data(), optimizer=spec, num_devices=1, steps=3
    )
    assert report.passed, format_parity(report)
    with pytest.raises(ValueError, match=r"groups\[0\] names \['head.bias'\], which torch_model"):
        compare_models(
            team.Net,
            team_jax_port.JaxNet,
            team.data(),
            optimizer=OptimizerSpec("sgd", 0.1, groups=(ParamGroup(("head.bias",)),)),
        )


def test_the_recorder_alone_in_one_process():
    """Without a process group: world size 1, the record's fields; the rules it enforces."""
    torch.manual_seed(0)
    model = team.Net().double()
    optimizer = torch.optim.AdamW(team.param_groups(model), lr=team.LR)
    recorder = torch_ref.Recorder(model, optimizer)
    x = torch.randn(3, 6, dtype=torch.float64)
    y = torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match=r"before optimizer.step\(\)"):
        recorder.micro_batch(x, y)
        recorder.step(0.0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    recorder.step(1.5)
    assert recorder.record.num_devices == 1 and recorder.record.losses == [1.5]
    assert (recorder.record.accum_steps, recorder.record.micro_batch_size) == (1, 3)
    with pytest.raises(ValueError, match=r"needs a path: path= or \$TORCH_REF_RECORD"):
        recorder.save()
    adam = torch.optim.Adam(model.parameters(), weight_decay=0.1)
    with pytest.raises(ValueError, match=r"Adam has no optax twin here"):
        torch_ref.Recorder(model, adam)
    betas = torch.optim.AdamW(
        [{"params": [model.fc1.weight]}, {"params": [model.fc1.bias], "betas": (0.8, 0.9)}]
    )
    with pytest.raises(ValueError, match=r"param_groups\[1\] sets betas=\(0.8, 0.9\)"):
        torch_ref.Recorder(model, betas)

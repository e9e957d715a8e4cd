"""compare_models on ports in each library jaxdp takes (library_ports.py): a torch model with
RMSNorm and its Flax NNX, Flax Linen and equinox ports train alike in float64 with no
mapping, a wrong epsilon is located in ``norm``, a Linen port carries BatchNorm
statistics as DDP's ranks do, and `jaxdp parity --jax-model` takes a Linen and an equinox
port."""

import functools
import pathlib

import equinox as eqx
import library_ports as lp
import numpy as np
import optax
import pytest

from jaxdp.cli._main import main
from jaxdp.parity import RTOL, OptimizerSpec, compare, compare_models, format_parity
from jaxdp.parity._locate import STAGES
from jaxdp.parity._port import prepare, run_jax_port, torch_trajectory

# One xdist worker runs this module's tests, each marked: the command's tests reuse the
# programs the ports' tests compiled in its process. Not the BatchNorm cell, which reads
# the torch batch with that batch's tests (conftest.py; a module-wide mark put it in a
# group of its own, "ports_torch_runs", run apart, which made the batch again).
ports = pytest.mark.xdist_group("ports")

MODELS = pathlib.Path(__file__).parent / "library_ports.py"
ADAMW = OptimizerSpec("adamw", 1e-2, weight_decay=1e-2)
LAYOUT = dict(num_devices=1, accum_steps=2, micro_batch_size=4)
PORTS = {  # library: (the port, the port with epsilon 1e-5)
    "nnx": (lp.NNXRMSNet, lp.nnx_flax_epsilon),
    "linen": (lp.LinenRMSNet, lp.linen_flax_epsilon),
    "equinox": (lp.EqxRMSNet, lp.eqx_flax_epsilon),
}


@ports
@pytest.mark.parametrize("library", PORTS)
def test_rms_norm_port_trains_like_torch_without_a_mapping(library):
    report = compare_models(
        lp.TorchRMSNet, PORTS[library][0], lp.features(), optimizer=ADAMW, steps=5, **LAYOUT
    )
    assert report.passed and len(report.max_abs) == 5, format_parity(report)
    assert report.rtol == RTOL["float64"]  # 1e-10: the dtype's tolerance, not a looser one
    assert {"fc1", "norm", "fc2"} == {name.split(".")[0] for name in report.max_abs[0]}


@ports
@pytest.mark.parametrize("library", PORTS)
def test_a_wrong_rms_norm_epsilon_is_located_in_norm(library):
    report = compare_models(
        lp.TorchRMSNet, PORTS[library][1], lp.features(), optimizer=ADAMW, steps=1, **LAYOUT
    )
    found = report.divergence
    assert report.first_failure == 1, format_parity(report)
    assert (found.stage, found.module) == ("forward", "norm"), found.describe()
    scale = "norm.weight" if library == "equinox" else "norm.scale"
    assert found.names == [scale], found.describe()


CLIP = OptimizerSpec("sgd", 0.1, momentum=0.9, max_grad_norm=0.01)


@ports
@pytest.mark.parametrize("library", ["linen", "equinox"])
def test_locator_reaches_the_optimizer_of_a_linen_and_an_equinox_port(library):
    """Every stage runs (the learning rate aside: the port's own optax chain does not say
    it): the accumulated gradient and the optimizer replay read jaxdp's step's parameter
    tree under the port's names; optax's clipping is not torch's, and the momentum buffer
    holding the clipped gradient is the first quantity that differs."""
    report = compare_models(
        lp.TorchRMSNet,
        PORTS[library][0],
        lp.features(),
        optimizer=CLIP,
        jax_optimizer=optax.chain(optax.clip_by_global_norm(0.01), optax.sgd(0.1, momentum=0.9)),
        steps=1,
        **LAYOUT,
    )
    found = report.divergence
    compared = [s for s in STAGES if s != "learning rate"]
    assert [s.stage for s in found.stages] == compared, found.describe()
    assert (found.stage, found.kind) == ("optimizer moments",) * 2, found.describe()
    kernel = "fc2.weight" if library == "equinox" else "fc2.kernel"
    assert kernel in found.names, found.describe()


@ports
def test_frozen_torch_parameters_stay_frozen_in_a_linen_port():
    report = compare_models(
        lp.torch_rms_net_frozen_bias, lp.LinenRMSNet, lp.features(), steps=3, **LAYOUT
    )
    assert report.passed, format_parity(report)
    assert report.max_abs[-1]["fc1.bias"] == 0.0  # never moved on either side


# The BatchNorm cell's layout: two devices against two DDP ranks.
BN_LAYOUT = dict(num_devices=2, accum_steps=2, micro_batch_size=4, steps=4, dtype="float64")
BN_LAYOUT |= dict(path="fused", strategy="shard_map", shuffle=True, seed=0, last_window="drop")


@functools.cache
def linen_bn_port():
    """compare_models' own preparation of the BatchNorm cell (what it runs on each side)."""
    return prepare(
        lp.TorchBNNet,
        lp.LinenBNNet,
        lp.features(64),
        loss="cross_entropy",
        optimizer=ADAMW,
        jax_optimizer=None,
        mapping=None,
        step_options=None,
        torch_device="cpu",
        **BN_LAYOUT,
    )


def torch_jobs() -> dict[str, tuple]:
    """The BatchNorm cell's DDP run, for the run's shared batch (conftest.py's torch_batch:
    one start of 2 ranks for this file and the others, not one of its own)."""
    return {"linen_bn": linen_bn_port().torch_job()}


def test_linen_port_carries_batch_norm_statistics_as_ddp_ranks_do(torch_batch):
    """Two devices against two DDP ranks: the batch statistics of each device's own rows
    (batch_stats='local'), rank 0's running statistics compared after every step. What
    compare_models(..., num_devices=2) runs and compares, its DDP run from the batch."""
    port = linen_bn_port()
    result = torch_batch[__name__]["linen_bn"]
    report = compare(port.config, run_jax_port(port), torch_trajectory(port, result))
    assert report.passed, format_parity(report)
    assert {"bn.mean", "bn.var", "bn.scale", "bn.bias"} <= set(report.max_abs[0])


@ports
def test_flax_batch_norm_differs_from_torch_in_its_running_variance_only():
    """linen.BatchNorm's running variance takes the batch's biased variance, torch's the
    unbiased one (with 4 rows a micro-batch, 3/4 of it); everything else agrees."""
    report = compare_models(
        lp.TorchBNNet, lp.linen_flax_batch_norm, lp.features(), steps=2, locate=False, **LAYOUT
    )
    beyond = {name for name, rel in report.max_rel[0].items() if rel > report.rtol}
    assert (report.first_failure, beyond) == (1, {"bn.var"}), format_parity(report)


@ports
@pytest.mark.parametrize("port", ["LinenRMSNet", "EqxRMSNet"])
def test_parity_command_takes_a_linen_and_an_equinox_port(tmp_path, port, monkeypatch, capsys):
    """The command's own code (flags, the models loaded from a file, the report, the exit
    status) in this process: a fresh process and its device count are
    test_parity_cli.py's, which starts the command once. This process's backend has 8
    devices already; the command's num_devices=1 takes the first."""
    x, y = lp.features()
    np.savez(tmp_path / "features.npz", x=x, y=y)
    monkeypatch.setattr("jaxdp._mesh.emulate_cpu_devices", lambda num_devices: None)
    status = main(
        ["parity", "--torch-model", f"{MODELS}:TorchRMSNet"]
        + ["--jax-model", f"{MODELS}:{port}", "--data", str(tmp_path / "features.npz")]
        + ["--num-devices", "1", "--accum-steps", "2", "--steps", "3"]
    )
    out = capsys.readouterr()
    assert status == 0, out.out + out.err
    lines = out.out.splitlines()
    assert lines[0].startswith(f"parity: TorchRMSNet vs {port}, adamw, float64"), lines[0]
    assert "norm" in lines[lines.index("max relative difference per step and parameter group:") + 1]
    assert lines[-1] == "PASS: every step within tolerance"


@ports
def test_a_stateful_equinox_port_is_refused_before_anything_trains():
    def stateful(key):
        return eqx.nn.Sequential(
            [eqx.nn.Linear(8, 4, key=key), eqx.nn.BatchNorm(4, "batch", mode="batch")]
        )

    with pytest.raises(TypeError, match=r"the equinox module has stateful layers"):
        compare_models(lp.TorchRMSNet, stateful, lp.features(), **LAYOUT)

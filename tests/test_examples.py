"""Every example runs with its quick flag and prints what its docstring promises.

Each runs as ``python examples/<name>.py --quick`` would run it, but in a worker of jaxdp's
pytest plugin started with the devices the example asks for (``runpy``, as ``__main__``,
its folder first on ``sys.path``, JAX in float32 as in a fresh process): what the tests
read is the script's output, not its process, and one worker's JAX start, imports and
compiled small programs serve every example (this file alone, one fresh process per run:
87.7 CPU s; in the workers: 67.7, with char_gpt's quick run at 16 steps instead of 40).
"""

import ast
import importlib.util
import pathlib
import re
import runpy
import shutil
import sys

import jax
import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"
SEED_WEIGHTS = "[0.9472, 0.9440, 0.9527, 0.9687, 0.9570, 0.9343, 0.9411, 0.9186]"


@pytest.fixture
def run(capsys, monkeypatch):
    """``run(name, *args)``: ``examples/<name>.py --quick *args`` as ``__main__`` in this
    process, its stdout returned. The suite's float64 (tests/conftest.py) is off for the
    run, as it is in the example's own process."""

    def run_example(name: str, *args: str) -> str:
        path = str(EXAMPLES / f"{name}.py")
        monkeypatch.setattr(sys, "argv", [path, "--quick", *args])
        monkeypatch.syspath_prepend(str(EXAMPLES))
        capsys.readouterr()
        x64 = jax.config.jax_enable_x64
        jax.config.update("jax_enable_x64", False)
        try:
            runpy.run_path(path, run_name="__main__")
        finally:
            jax.config.update("jax_enable_x64", x64)
        return capsys.readouterr().out

    return run_example


def number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in:\n{text}"
    return float(match.group(1))


def test_every_example_documents_its_command_and_output():
    for path in sorted(EXAMPLES.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert f"python examples/{path.name}" in doc, path.name
        assert "Expected output" in doc, path.name
        assert len(path.read_text().splitlines()) < 200, path.name


@pytest.mark.devices(2)  # the example's own count
def test_seed_equivalence_prints_the_seeds_weights(run):
    out = run("seed_equivalence")
    assert out.count(f"weights: {SEED_WEIGHTS}") == 2  # 1 device x 2 steps, 2 devices x 1
    assert "num_devices=1 x accum_steps=2 x micro_batch_size=4" in out
    assert "num_devices=2 x accum_steps=1 x micro_batch_size=4" in out
    # float32: the same 8 rows summed in another order; observed 0.
    assert number(r"max \|1 device - 2 devices\| = (\S+)", out) <= 1e-6


@pytest.mark.devices(2)
def test_seed_equivalence_without_torch_uses_the_same_numbers(run, monkeypatch):
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location(
        "seed_equivalence", EXAMPLES / "seed_equivalence.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    np.testing.assert_array_equal(np.asarray(example.SEED_X, np.float32), torch.rand(8, 8).numpy())
    # `import torch` fails during the run: the example falls back to the hard-coded values.
    monkeypatch.setitem(sys.modules, "torch", None)
    out = run("seed_equivalence")
    assert "(hard-coded)" in out
    assert out.count(f"weights: {SEED_WEIGHTS}") == 2


@pytest.mark.devices(4)  # the example's own count
def test_digits_cnn_learns(run):
    out = run("digits_cnn")
    assert "global_batch_size=128 = num_devices=4 x accum_steps=2 x micro_batch_size=16" in out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 8 and losses[-1] < losses[0] / 2
    # The docstring's quick floor; observed 85.8% (chance: 10%).
    assert number(r"held-out accuracy: ([\d.]+)%", out) >= 80.0


@pytest.mark.devices(4)  # the example's own count
def test_char_gpt_learns_and_samples(run):
    out = run("char_gpt")
    before = number(r"held-out loss before training: ([\d.]+)", out)
    after = number(r"held-out loss after 16 steps: ([\d.]+)", out)
    # The docstring's quick ceiling; observed 2.96 from 5.34 (uniform: ln 103 = 4.63).
    assert after < 3.3 < before
    sample = re.search(r"sample: (The .*)", out, re.S).group(1)
    assert len(sample) >= 4 + 80


@pytest.mark.devices(4)
def test_char_gpt_from_a_token_memmap_resumes_at_the_same_windows(run, tmp_path):
    out = run("char_gpt_memmap", "--dir", str(tmp_path))
    assert np.fromfile(tmp_path / "tokens.u16", np.uint16).max() == 102  # 103 characters
    losses = dict(re.findall(r"step +(\d+)/12: loss (\S+)", out))
    assert list(losses) == [str(s) for s in range(1, 13)]
    assert float(losses["12"]) < float(losses["1"]) - 1.0
    assert "checkpoint at step 6: next epoch 0 batch 6" in out
    # As if killed before the checkpoint of step 12: resume from step 6's.
    shutil.rmtree(tmp_path / "checkpoints" / "12")
    again = run("char_gpt_memmap", "--dir", str(tmp_path), "--resume")
    assert (
        "resumed at step 6: next SamplerPosition(epoch=0, step_in_epoch=6, micro_batch=0)" in again
    )
    resumed = dict(re.findall(r"step +(\d+)/12: loss (\S+)", again))
    assert resumed == {s: loss for s, loss in losses.items() if int(s) > 6}  # the same windows
    held_out = r"held-out loss after 12 steps: ([\d.]+)"
    # Observed 3.02 after 12 steps (uniform over 103 characters: ln 103 = 4.63).
    assert number(held_out, again) == number(held_out, out) < 3.5


@pytest.mark.devices(4)  # the example's own count
def test_own_model_is_equivalent_in_under_30_lines(run):
    source = (EXAMPLES / "own_model.py").read_text()
    adaptation = source.split("# --- jaxdp: begin ---")[1].split("# --- jaxdp: end ---")[0]
    code = [
        line
        for line in adaptation.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert len(code) < 30
    out = run("own_model")
    assert number(r"max \|jaxdp - single device\| over all weights: (\S+)", out) < 1e-5
    assert "equivalent: True" in out
    assert number(r"held-out accuracy ([\d.]+)%", out) >= 80.0

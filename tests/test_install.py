"""What `pip install jaxdp` pulls: the library's dependencies, not the command line's."""

import json
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).parent.parent
CORE = {"jax", "flax", "optax", "numpy", "orbax-checkpoint"}
COMMAND_LINE = {
    "filelock",  # the compilation cache's lock (its size bound)
    "scikit-learn",
    "tqdm",
    "matplotlib",
    "grain",
    "tensorboardx",
}  # as the wheel spells it
DATA = {"grain"}  # jaxdp.data's extra

# One xdist worker for the module: the wheel fixture is per worker, and two workers
# building at once collided in the checkout's build/ directory ("File exists:
# build/bdist.linux-x86_64/wheel/jaxdp-0.3.0.dist-info" in a whole run).
pytestmark = pytest.mark.xdist_group("wheel")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--wheel-dir", str(out), str(ROOT)],
        check=True,
        timeout=300,
    )
    (path,) = out.glob("jaxdp-*.whl")
    return path


def requirements(wheel):
    """``{(name, extra or None)}`` of the wheel's Requires-Dist."""
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(meta).decode()
    found = set()
    for line in re.findall(r"^Requires-Dist: (.*)$", text, re.M):
        name = re.match(r"[A-Za-z0-9_.\-]+", line).group(0).lower()
        extra = re.search(r"extra == \"([\w\-]+)\"", line)
        found.add((name, extra.group(1) if extra else None))
    return found, text


def test_the_wheel_declares_the_core_plain_and_the_command_line_as_an_extra(wheel):
    found, text = requirements(wheel)
    assert {name for name, extra in found if extra is None} == CORE
    assert {name for name, extra in found if extra == "cli"} == COMMAND_LINE
    assert {name for name, extra in found if extra == "data"} == DATA
    assert not any(name == "torch" for name, _ in found)  # PyTorch comes from its own index
    assert "Typing :: Typed" in text and "Project-URL: Source," in text
    with zipfile.ZipFile(wheel) as z:
        assert "jaxdp/py.typed" in z.namelist()


def test_the_wheel_ships_no_benchmarks(wheel):
    """The benchmark harness stays in the repository (benchmarks/), out of the package."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert any(n.startswith("jaxdp/cli/") for n in names)  # the command line is there
    assert [n for n in names if "bench" in n] == []


def test_installing_the_wheel_without_extras_pulls_no_command_line_or_torch(wheel, tmp_path):
    report = tmp_path / "report.json"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed"]
        + ["--report", str(report), str(wheel)],
        check=True,
        timeout=600,
    )
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert {"jaxdp", *CORE} <= names
    assert not names & (COMMAND_LINE | {"torch"})

"""README.md and docs/*.md as written: their Python runs, their commands parse with
jaxdp's own parser, their links resolve, and docs/api.md lists every public name."""

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import pathlib
import re
import shlex
import subprocess
import sys
from collections import Counter
from unittest import mock

import pytest

from jaxdp.cli import main
from jaxdp.cli._launch import child_argv

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
FILES = [README, *PAGES]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SUBPACKAGES = (
    "jaxdp",
    "jaxdp.checkpoint",
    "jaxdp.data",
    "jaxdp.models",
    "jaxdp.parity",
    "jaxdp.plan",
    "jaxdp.testing",
    "jaxdp.cli",
)

# The README's start, word for word: the two commands, then the sentence on a fresh clone.
README_COMMANDS = (
    "bin/jaxdp train   # data-parallel MLP on the digits images, 4 emulated CPU devices, "
    "~98% held-out accuracy",
    "bin/test          # the whole test suite (lint, pytest, the core on the newest jax), "
    "~15 min on 2 cores",
)
README_START = "# jaxdp\n\n```bash\n{}\n```\n\n{}".format(
    "\n".join(README_COMMANDS),
    "Both work on a fresh clone: the first run creates a local virtual environment\n"
    "`.venv` (Python >= 3.10, about a minute) with jaxdp, its test tools and the CPU\n"
    "build of torch, pinned by `constraints/cpu.txt`.\n",
)

# Checks run after the Python block of that index (-1: after the last), in its namespace.
CHECKS = {
    "README.md": {
        -1: """
assert int(state.step) == 1, int(state.step)
assert isinstance(trained, nnx.Sequential)
print("nnx ok")
""",
    },
    "api.md": {
        # Only set, nothing compiled: the home directory's cache is not written.
        -1: """
assert jax.config.jax_compilation_cache_dir == os.path.expanduser("~/.cache/jaxdp/xla")
assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.1
""",
    },
    "semantics.md": {
        0: """
assert schedule.rows[0].tolist() == [0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11]
""",
        1: """
assert (len(schedule.rows), len(last.rows)) == (2, 3)
assert last.micro_weights[-1].tolist() == [1.0, 0.0]
""",
        2: """
expected = float((y.astype(np.float64) ** 2 * mask).sum() / mask.sum())
assert abs(float(metrics["loss"]) - expected) < 1e-5, (float(metrics["loss"]), expected)
""",
        3: """
reduces = jaxdp.testing.all_reduces(step.compile(state, (x, y, mask)))
assert [(r.bytes, r.executions) for r in reduces] == [(24, (1, 1))], reduces
""",
        4: """
found = {c.kind: c for c in jaxdp.testing.collectives(zero.compile(zero_state, batch))}
assert found["reduce-scatter"].bytes == found["all-gather"].bytes == 96, found
assert found["all-reduce"].bytes == 24 and zero_state.opt_state[0].mu["w"].shape == (6, 4)
""",
        5: """
import jax
window = mixed_state.window
assert (int(mixed_state.step), int(window.position)) == (1, 1)
for name, tree in [("params", mixed_state.params), ("mu", adam.mu), ("nu", adam.nu),
                   ("window", (window.grads, window.loss_sum, window.weight))]:
    assert {str(x.dtype) for x in jax.tree.leaves(tree)} == {"float32"}, name
assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(window.grads))
assert set(re.findall(r"(\\w+)\\[[\\d,]*\\]\\{[\\d,]*\\} dot\\(", hlo)) == {"bf16"}
wire = [c.shapes[0] for c in jaxdp.testing.collectives(hlo)]
assert wire == ["bf16[16]", "bf16[4,16]", "bf16[1]", "bf16[16,1]", "f32[]", "f32[]"], wire
""",
        6: """
close = ((y**2 < 1) * mask).sum() / mask.sum()  # at w = 0, before the update
assert abs(float(aux_metrics["aux"]["close"]) - close) < 1e-6, (aux_metrics, close)
assert abs(float(aux_metrics["loss"]) - 0.6817) < 1e-4, aux_metrics  # the loss as before
assert "learning_rate" not in metrics  # optax.sgd(0.1) keeps no learning rate in its state
# The value each update used, in float32 (XLA may round the schedule's multiply-add once,
# where optax outside jit rounds twice: 0.025000000372 against 0.024999998510).
np.testing.assert_allclose(rates, [0.0, 0.025, 0.05], rtol=2**-23, atol=0)
""",
        7: """
assert meter.flops == 2 * 2 * 12 * 5 * 4, meter.flops
assert logged["learning_rate"] == float(lr_metrics["learning_rate"]) > 0  # inject_hyperparams'
assert logged["mfu"] == logged["flops_per_s"] / (1e9 * 2)
""",
        # Tensor parallelism: each device holds its model shard, and its data block of
        # Adam's moment.
        -1: """
P = jax.sharding.PartitionSpec
kernel, mu = tp_state.params["fc1"]["kernel"], tp_state.opt_state[0].mu["fc1"]["kernel"]
assert (kernel.sharding.spec, mu.sharding.spec) == (P(None, "model"), P("data", "model"))
assert {s.data.shape for s in kernel.addressable_shards} == {(4, 4)}
assert {s.data.shape for s in mu.addressable_shards} == {(2, 4)}
assert int(tp_state.step) == 1  # the update applied
""",
    },
    "model-state.md": {
        0: "assert int(step.model(state).layers[1].num_batches_tracked[...]) == 2",
        1: """
assert state.params["b"].tolist() == [1.0]
assert isinstance(state.opt_state[0].mu["b"], optax.MaskedNode)
assert [r.bytes for r in jaxdp.testing.all_reduces(step.compile(state, batch))] == [24]
""",
        3: """
assert isinstance(trained, LinenNet) and len(jax.tree.leaves(linen_state.params)) == 6
assert not np.allclose(new_variables["batch_stats"]["BatchNorm_0"]["mean"], 0)
assert new_variables["batch_stats"]["BatchNorm_0"]["var"].dtype == np.float32
""",
        4: """
assert not np.allclose(
    eqx_step.model(eqx_state).hidden.weight, EqxNet(jax.random.key(0)).hidden.weight
)
""",
        -1: "assert (int(state.step), int(metrics['skipped_steps'])) == (1, 1)",
    },
    "checkpoints.md": {
        -1: """
assert checkpoints.steps == [2] and checkpoints.metadata().samples == 32
assert isinstance(checkpoints.metadata(), jaxdp.checkpoint.Metadata)
assert isinstance(restored, jaxdp.checkpoint.Restored)
assert int(restored.state.step) == 2
assert restored.position == jaxdp.SamplerPosition(0, 2, 0)
np.testing.assert_array_equal(restored.state.params["w"], state.params["w"])
assert (int(back.state.step), back.data, back.sizes) == (3, {"epoch": 0, "offset": 48}, None)
np.testing.assert_array_equal(back.state.params["w"], mine.params["w"])
""",
    },
    "data.md": {
        0: """
assert again.position == restored.position == jaxdp.SamplerPosition(1, 2, 0)
np.testing.assert_array_equal(restored.state.params, state.params)
assert again.samples == loader.samples == 7 * sizes.global_batch_size  # 5 + 2 steps
""",
        2: """
assert first["x"].shape == (16, 6) and first["label"].shape == (16,)
np.testing.assert_array_equal(np.asarray(first["x"])[0], columns["x"][int(
    jaxdp.epoch_schedule(64, split, seed=0).rows[0][0])])
""",
        4: """
assert calls == shards.reads == 4
""",
        -1: """
assert feed.sizes == jaxdp.batch_sizes(num_devices=2, accum_steps=2, micro_batch_size=4)
assert int(trained.step) == 4  # 64 rows, 16 a step
""",
    },
    "scaling-out.md": {
        2: """
assert int(state.step) == 4 and checkpoints.steps == [2, 4]
again = train(epochs=3)  # a rerun finds checkpoint 4: the third epoch's 2 steps only
assert int(again.step) == 6 and checkpoints.steps == [2, 4, 6]
""",
        -1: "assert (share.process_count, share.rows) == (1, slice(0, 128))",
    },
    "memory-planning.md": {
        0: "assert (plan.micro_batch_size, plan.accum_steps) == (128, 4)",
        -1: """
w_bytes = 256 * 256 * 4
assert memory.arguments >= 3 * w_bytes, memory  # weights and Adam's two moments
assert memory.temporaries >= w_bytes, memory  # at least the gradient accumulator
""",
    },
    "testing.md": {
        # Its first block, a test file, runs in tests/test_testing_plugin.py.
        1: """
try:
    jaxdp.emulate_cpu_devices(8)
except RuntimeError as err:
    assert "after the JAX backend started with 1 CPU device(s)" in str(err), err
else:
    raise AssertionError("emulate_cpu_devices(8) after the backend started was allowed")
""",
    },
    "parity.md": {-1: "assert report.passed and len(report.max_abs) == 3"},
    "check-your-port.md": {
        1: "assert report.passed and len(report.max_abs) == 5",
        2: """
found = broken.divergence
assert (broken.first_failure, found.stage, found.module) == (1, "forward", "norm"), found
assert found.names == ["norm.bias", "norm.scale"], found.names
""",
        3: "assert fixed.passed and 'inp.kernel' in fixed.max_abs[0]",
        4: """
assert rms.passed and "norm.scale" in rms.max_abs[0], rms.max_abs[0]
found = rms_default.divergence
assert (found.stage, found.module, found.names) == ("forward", "norm", ["norm.scale"]), found
""",
        6: """
for r in (linen_report, eqx_report):
    assert r.passed and len(r.max_abs) == 3 and r.rtol == 1e-10, r.max_rel
assert sorted(linen_report.max_abs[0])[:2] == ["fc1.bias", "fc1.kernel"]
assert sorted(eqx_report.max_abs[0])[:2] == ["fc1.bias", "fc1.weight"]
""",
        # A Hugging Face GPT-2 (Conv1D) into an NNX port (issue 34 item 1).
        8: "assert np.abs(ours - theirs).max() <= 1e-12 * np.abs(theirs).max()",
        9: """
assert gpt2.passed and gpt2.rtol == 1e-10 and len(gpt2.max_abs) == 2, gpt2.max_rel
assert "transformer.h.0.attn.c_proj.kernel" in gpt2.max_abs[0]
""",
        10: """
found = wrong.divergence
assert (wrong.first_failure, found.stage, found.module) == (
    1, "forward", "transformer.h.0.attn.c_proj"
), found
""",
        # torch's nn.ModuleList into a port of stacked (nnx.vmap) layers and back.
        11: """
assert port.blocks.kernel.shape == (3, 8, 8) and list(back) == list(tower.state_dict())
assert np.abs(np.asarray(port(h)) - tower(torch.from_numpy(h)).detach().numpy()).max() < 1e-14
""",
    },
}


def blocks(path: pathlib.Path, language: str) -> list[str]:
    return [code for lang, code in BLOCK.findall(path.read_text()) if lang == language]


def runs_elsewhere(code: str) -> bool:
    # torch_ref's DDP example spawns ranks that re-import it as __main__, so it runs
    # on its own: parity_tests/test_torch_ref.py::test_docs_torch_ref_example_runs. The
    # GPU topology's needs jax's CUDA plugin: tests/gpu/test_docs_gpu.py runs it. The
    # testing page's test file runs under pytest beside the plugin's own example suite,
    # on its workers: tests/test_testing_plugin.py::test_each_test_gets_its_outcome.
    return "import torch_ref" in code or "gpu_mesh(" in code or "@pytest.mark.devices(" in code


# ---- Python blocks ------------------------------------------------------------------------


# Pages that need no process of their own share one interpreter with the pages that set
# the same emulated device count (a page that set another would fail, emulate_cpu_devices
# naming both counts): each page runs as __main__ in a fresh namespace, the environment
# restored after it. One interpreter start (the
# imports, the first compiles) for the group instead of one per page; each page keeps its
# test and its output. In order: what a page leaves set in JAX must not matter to the
# pages after it (check-your-port.md and parity.md turn on float64, which testing.md's
# blocks, compiling nothing, do not see; api.md points the compilation cache at the home
# directory, so it comes last and nothing compiles after it).
SHARED = {
    "1 device": ("check-your-port.md", "parity.md", "testing.md", "api.md"),
    "2 devices": ("checkpoints.md", "data.md", "memory-planning.md", "model-state.md"),
    "4 devices": ("semantics.md", "scaling-out.md"),
}
PAGE_MARK = "@@docs page "
PAGE_FAILED = "@@docs failed"
DRIVER = f"""
import os, runpy, sys, traceback
for name, path in PAGES:
    for stream in (sys.stdout, sys.stderr):
        print({PAGE_MARK!r} + name, file=stream, flush=True)
    environ = dict(os.environ)
    try:
        runpy.run_path(path, run_name="__main__")
    except (Exception, SystemExit):
        traceback.print_exc()
        print({PAGE_FAILED!r}, flush=True)
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.environ.clear()
        os.environ.update(environ)
"""


def doc_script(path: pathlib.Path) -> str:
    """The page's Python blocks (but the one that runs elsewhere), each followed by its
    checks from CHECKS, as one script."""
    checks = CHECKS.get(path.name, {})
    code = [b for b in blocks(path, "python") if not runs_elsewhere(b)]
    assert set(checks) <= {-1, *range(len(code))}, "a check names a block that is not there"
    script = []
    for i, block in enumerate(code):
        script += [block, checks.get(i, "")]
    script.append(checks.get(-1, ""))
    return "\n".join(script)


def by_page(output: str) -> dict[str, str]:
    """A shared interpreter's stdout or stderr, split at the driver's page marks."""
    pages = re.split(f"^{re.escape(PAGE_MARK)}(.*)\n", output, flags=re.M)
    return dict(zip(pages[1::2], pages[2::2], strict=True))


@pytest.fixture(scope="module")
def shared_interpreter(tmp_path_factory):
    """``outcome(group, page)``: whether the page's script ran to its end, its stdout and its
    stderr, from one interpreter running every page of ``SHARED[group]`` (on first request)."""
    runs = {}

    def outcome(group: str, page: str) -> tuple[bool, str, str]:
        if group not in runs:
            folder = tmp_path_factory.mktemp("docs")
            pages = []
            for name in SHARED[group]:
                (folder / name).with_suffix(".py").write_text(doc_script(ROOT / "docs" / name))
                pages.append((name, str((folder / name).with_suffix(".py"))))
            (folder / "driver.py").write_text(f"PAGES = {pages!r}\n{DRIVER}")
            runs[group] = subprocess.run(
                [sys.executable, str(folder / "driver.py")],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300 * len(pages),
            )
        done = runs[group]
        out, err = by_page(done.stdout).get(page), by_page(done.stderr).get(page, "")
        if out is None:  # the interpreter died before this page
            return False, done.stdout, f"exit status {done.returncode}\n{done.stderr}"
        return not out.endswith(PAGE_FAILED + "\n"), out, err

    return outcome


def python_pages():
    for path in FILES:
        if not blocks(path, "python"):
            continue
        group = next((g for g, names in SHARED.items() if path.name in names), None)
        marks = [pytest.mark.xdist_group(f"docs {group}")] if group else []
        yield pytest.param(path, group, marks=marks, id=path.name)


@pytest.mark.parametrize(("path", "group"), python_pages())
def test_python_blocks_run(path, group, tmp_path, shared_interpreter):
    if group is not None:
        ran, stdout, stderr = shared_interpreter(group, path.name)
    else:
        (tmp_path / "doc.py").write_text(doc_script(path))
        out = subprocess.run(
            [sys.executable, str(tmp_path / "doc.py")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        ran, stdout, stderr = out.returncode == 0, out.stdout, out.stderr
    assert ran, stdout[-2000:] + stderr[-4000:]
    if path == README:
        # 1024 rows over 4 ranks: 256 each, 8 steps of 2 x 16 per epoch; the fit
        # converges (the loss starts at E[(sum of 8 normals)^2] = 8).
        first, *_, last = stdout.splitlines()
        steps, loss, _ = first.split()
        assert steps == "40" and float(loss) < 0.1, first
        assert last == "nnx ok"
    if path.name == "model-state.md":
        assert "choose batch_stats='local'" in stdout


def test_only_the_torch_ref_gpu_and_test_file_examples_run_elsewhere():
    elsewhere = [p.name for p in FILES for b in blocks(p, "python") if runs_elsewhere(b)]
    assert elsewhere == ["parity.md", "scaling-out.md", "testing.md"]


# ---- bash blocks ----------------------------------------------------------------------------


def parse_jaxdp(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace | None]:
    """argv parsed by the parser `jaxdp` itself builds (jaxdp.cli.main), without running
    it: the parser, and the namespace (None after --help)."""

    class Parsed(Exception):
        pass

    real_init, real_parse = argparse.ArgumentParser.__init__, argparse.ArgumentParser.parse_args

    def exact(self, *args, **kwargs):  # a renamed flag must not pass as an abbreviation
        real_init(self, *args, **{**kwargs, "allow_abbrev": False})

    def capture(self, args=None, namespace=None):
        raise Parsed(self, real_parse(self, args, namespace))

    err = io.StringIO()
    with (
        mock.patch.object(argparse.ArgumentParser, "__init__", exact),
        mock.patch.object(argparse.ArgumentParser, "parse_args", capture),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(err),
    ):
        try:
            main(argv)
        except Parsed as parsed:
            return parsed.args
        except SystemExit as e:  # --help exits 0; a bad flag or value exits 2
            assert e.code == 0, f"jaxdp {shlex.join(argv)}: {err.getvalue()}"
            return None, None
    raise AssertionError(f"jaxdp {shlex.join(argv)} was not parsed")


def commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line, without their environment assignments."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out, current = [], []
    for token in lexer:
        if token in (";", "&&", "||", "|", "&"):
            out.append(current)
            current = []
        elif current or not re.match(r"^\w+=", token):
            current.append(token)
    return [c for c in [*out, current] if c]


def check_line(line: str, seen: Counter) -> None:
    for words in commands(line):
        check_command(words, seen)


def check_command(words: list[str], seen: Counter) -> None:
    """jaxdp's arguments parse, a Python script exists, pip names real extras."""
    for flag, word in zip(words, words[1:], strict=False):
        if flag == "-c":  # sh -c '...': a command line of its own
            check_line(word, seen)
    if "pip" in words[:3] and "install" in words:
        check_pip(words[words.index("install") + 1 :])
        seen["pip"] += 1
        return
    for i, word in enumerate(words):
        if word.endswith("bin/jaxdp") and words[i + 1 : i + 2] == ["bench"]:  # a checkout's
            check_bench(words[i + 2 :], seen)
            return
        if word == "jaxdp" or word.endswith("/jaxdp"):  # also `python -m jaxdp`
            check_jaxdp(words[i + 1 :], seen)
            return
    if pathlib.Path(words[0]).name.startswith("python"):
        for word in words[1:]:
            if word.endswith(".py"):
                assert (ROOT / word).is_file(), f"{shlex.join(words)}: no {word}"
                seen["script"] += 1


def check_jaxdp(argv: list[str], seen: Counter) -> None:
    parser, args = parse_jaxdp(argv)
    seen["jaxdp"] += 1
    if args is not None and hasattr(args, "nprocs"):  # jaxdp launch ... -- COMMAND
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        check_command(child_argv(args.command, set(sub.choices)), seen)


def check_bench(argv: list[str], seen: Counter) -> None:
    """`bin/jaxdp bench`'s arguments parse with benchmarks/run.py's parser."""
    from benchmarks.harness._runner import parser

    bench = parser()
    bench.allow_abbrev = False  # a renamed flag must not pass as an abbreviation
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            bench.parse_args(argv)
        except SystemExit as e:  # --help exits 0; a bad flag or value exits 2
            assert e.code == 0, f"bin/jaxdp bench {shlex.join(argv)}: {err.getvalue()}"
    seen["jaxdp"] += 1


def check_pip(words: list[str]) -> None:
    tomllib = pytest.importorskip("tomllib")
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    for word in words:
        named = re.fullmatch(r"(jaxdp|\.)\[([\w,\-]+)\]", word)
        if named:
            assert set(named.group(2).split(",")) <= extras, f"pip install {word}: extras {extras}"


@pytest.mark.parametrize("path", [p for p in FILES if blocks(p, "bash")], ids=lambda p: p.name)
def test_bash_blocks_name_real_flags_scripts_and_extras(path):
    seen = Counter()
    for block in blocks(path, "bash"):
        for line in block.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                check_line(line, seen)
    assert seen, f"{path.name}: no command checked"


# ---- README, links, API ---------------------------------------------------------------------


def test_readme_is_a_way_in():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert text.startswith(README_START)


def test_readme_installing_names_every_extra_a_user_installs():
    """Every extra of pyproject.toml but the developers' ``test`` and ``test-core`` has its
    line under README's "Installing" (jaxdp[data] was missing while docs/data.md required
    it)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    section = README.read_text().split("## Installing", 1)[1].split("\n## ", 1)[0]
    named = {e for group in re.findall(r"jaxdp\[([\w,\-]+)\]", section) for e in group.split(",")}
    developers = {"test", "test-core"}
    assert set(extras) - developers <= named, f"README's Installing names {named}: add the others"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_links_resolve(path):
    for target in LINK.findall(path.read_text()):
        if re.match(r"^[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name} links to {target}: no such file"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.M)
            assert anchor in {slug(h) for h in headings}, f"{path.name} links to {target}"


def test_readme_links_every_page_in_docs():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(README.read_text())}
    assert set(PAGES) <= linked, sorted(p.name for p in set(PAGES) - linked)


def documented(module: str) -> list[str]:
    """The names docs/api.md lists (``- `name`: ...``) under its heading for ``module``."""
    text = (ROOT / "docs" / "api.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)
    (section,) = [s for s in sections if s.startswith(f"`{module}`\n")]
    return re.findall(r"^- `(\w+)`:", section, re.M)


@pytest.mark.parametrize("module", SUBPACKAGES)
def test_api_page_lists_exactly_the_public_names(module):
    public = importlib.import_module(module).__all__
    listed = documented(module)
    assert sorted(listed) == sorted(public)
    assert len(listed) == len(set(listed))


def docstring(module: str, name: str) -> str | None:
    """The docstring of ``name`` where it is defined: a class's or function's, or the string
    right after an assignment (an attribute docstring, as Sphinx reads it)."""
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = path.with_suffix("") / "__init__.py"
    body = []
    for node in ast.parse(path.read_text()).body:
        # A lazy package (jaxdp/__init__.py) names its imports under `if TYPE_CHECKING:`.
        body += node.body if isinstance(node, ast.If) else [node]
    for i, node in enumerate(body):
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            source = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            return docstring(source, name)
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return ast.get_docstring(node)
        targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            after = body[i + 1] if i + 1 < len(body) else None
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                return after.value.value
            return None
    raise AssertionError(f"{name} is not defined in {module}")


@pytest.mark.parametrize("module", SUBPACKAGES)
def test_every_public_name_has_a_docstring(module):
    missing = {
        (module, name)
        for name in importlib.import_module(module).__all__
        if not docstring(module, name)
    }
    assert missing == set()

"""What a process imports: ``import jaxdp`` no JAX until a core name is used, and the
command line's processes that end early (help, usage errors) or only launch others
none of JAX, torch, orbax or the plotting, logging and data libraries.

Each test runs a fresh interpreter and reads its real ``sys.modules`` at the end."""

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

import jaxdp

ROOT = pathlib.Path(__file__).parents[1]
# Top-level packages a start that does no training must not pay for.
HEAVY = {
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "numpy",
    "orbax",
    "torch",
    "matplotlib",
    "tensorboard",
    "tensorboardX",
    "grain",
    "transformers",
    "sklearn",
}


def run_python(code, *args, cwd=None):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_import_jaxdp_imports_no_jax_until_a_core_name_is_used():
    done = run_python(f"""
        import sys
        import warnings

        def heavy():
            return sorted({{m.split(".")[0] for m in sys.modules}} & set({sorted(HEAVY)!r}))

        import jaxdp
        print(heavy())
        print(set(jaxdp.__all__) <= set(dir(jaxdp)))
        step = jaxdp.make_train_step
        print("jax" in sys.modules, step.__module__)
        namespace = {{}}
        exec("from jaxdp import *", namespace)
        print(all(namespace[n] is getattr(jaxdp, n) for n in jaxdp.__all__))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print(jaxdp.AccumState is jaxdp.Window, caught[0].category.__name__)
        jaxdp.emulate_cpu_devices(3)  # JAX's backend has not started yet
        import jax
        print(len(jax.devices()))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "[]",
        "True",
        "True jaxdp._step",
        "True",
        "True DeprecationWarning",
        "3",
    ]


def test_the_lazy_names_are_the_ones_type_checkers_see():
    """``jaxdp.__init__``'s TYPE_CHECKING imports and its table of where each name is
    imported from at run time say the same, for every name of ``__all__``."""
    tree = ast.parse((ROOT / "jaxdp" / "__init__.py").read_text())
    imported = {
        alias.asname or alias.name: node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names
    }
    assert imported == jaxdp._HOMES
    assert set(jaxdp._HOMES) == set(jaxdp.__all__)


CLI = """
import sys
try:
    import jaxdp.cli
    status = jaxdp.cli.main(sys.argv[1:])
except SystemExit as e:
    status = e.code
finally:
    print("imported:", sorted({m.split(".")[0] for m in sys.modules} & HEAVY))
sys.exit(status)
"""


def run_cli(*argv, cwd=None):
    """``jaxdp ARGV`` in a fresh process: its exit status, stdout (less the last line),
    stderr, and the heavy packages it had imported when it ended."""
    done = run_python(f"HEAVY = set({sorted(HEAVY)!r})\n{CLI}", *argv, cwd=cwd)
    *out, last = done.stdout.splitlines()
    assert last.startswith("imported: "), done.stdout
    return done.returncode, "\n".join(out), done.stderr, last.removeprefix("imported: ")


@pytest.mark.parametrize(
    "argv, status, shown",
    [
        (["--help"], 0, "usage: jaxdp [-h] [--version] COMMAND"),
        (["--version"], 0, f"jaxdp {jaxdp.__version__} (jax "),
        (["launch", "--help"], 0, "usage: jaxdp launch [-h] --nprocs N"),
        (["train", "--help"], 0, "usage: jaxdp train [-h] [--model {mlp,cnn,gpt}]"),
        (["launch", "--nprocs", "2"], 2, "give the command to run after --"),
        (["launch", "--nprocs", "0", "--", "train"], 2, "nprocs=0 must be a positive integer"),
        (["launch", "--nprocs", "2", "--", "missing.py"], 2, "script 'missing.py' does not"),
        (["launch"], 2, "the following arguments are required: --nprocs"),
        (["train", "--steps", "0"], 2, "jaxdp train: error: steps=0 must be a positive integer"),
        (["bench"], 2, "jaxdp bench runs from a source checkout"),
        (["nonsense"], 2, "invalid choice: 'nonsense'"),
    ],
)
def test_help_and_usage_errors_import_no_jax_or_torch(tmp_path, argv, status, shown):
    code, out, err, imported = run_cli(*argv, cwd=tmp_path)
    assert code == status, err
    assert shown in (out if status == 0 else err)
    assert imported == "[]"


def test_the_launcher_process_imports_no_jax_while_its_ranks_run(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text("import os\nprint('rank', os.environ['JAXDP_PROCESS_ID'], 'of 2')\n")
    code, out, err, imported = run_cli("launch", "--nprocs", "2", "--", "rank.py", cwd=tmp_path)
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[rank 0] rank 0 of 2", "[rank 1] rank 1 of 2"]
    assert imported == "[]"

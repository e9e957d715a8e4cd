"""compare_models(num_devices=2) from a script: DDP's spawned ranks import the script
again, so a call outside ``if __name__ == "__main__":`` is refused, saying so, before
anything trains (issue 34 item 4)."""

import subprocess
import sys
import textwrap
import types

import pytest

from jaxdp.parity._main_guard import check_main_guard

SCRIPT = """
import jax

jax.config.update("jax_enable_x64", True)
import numpy as np
from flax import nnx
from torch import nn

from jaxdp.parity import compare_models


class TorchNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x)


class JaxNet(nnx.Module):
    def __init__(self, *, rngs):
        self.fc = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.fc(x)


x, y = np.zeros((16, 3)), np.zeros(16, int)
"""


def run(tmp_path, call):
    script = tmp_path / "port_check.py"
    script.write_text(SCRIPT + textwrap.dedent(call))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )


def test_a_call_outside_the_main_guard_is_refused_saying_what_to_add(tmp_path):
    done = run(tmp_path, "report = compare_models(TorchNet, JaxNet, (x, y), num_devices=2)\n")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ValueError: compare_models(num_devices=2) starts DDP ranks that import "
        "port_check.py again (torch's spawn), which would run this call again in each "
        f'rank: put it under `if __name__ == "__main__":` (line {len(SCRIPT.splitlines()) + 1})'
    ), done.stderr[-3000:]


@pytest.mark.parametrize(
    ("code", "refused_at"),
    [
        ("check('here')\n", 1),
        ("try:\n    check('here')\nexcept OSError:\n    pass\n", 2),
        ("def main():\n    check('here')\n\n\nmain()\n", 5),
        ("def main():\n    check('here')\n\n\nif __name__ == '__main__':\n    main()\n", None),
        ("if '__main__' == __name__:\n    check('here')\n", None),
    ],
    ids=["top level", "in a try", "a function called", "under the guard", "guard reversed"],
)
def test_the_check_reads_where_the_script_makes_the_call(tmp_path, monkeypatch, code, refused_at):
    # A script run as __main__, without starting Python: its file and its top-level frame.
    script = tmp_path / "train.py"
    script.write_text(code)
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    main.check = check_main_guard
    monkeypatch.setitem(sys.modules, "__main__", main)
    run_script = compile(code, str(script), "exec")
    if refused_at is None:
        exec(run_script, vars(main))
        return
    with pytest.raises(
        ValueError, match=rf"^here starts DDP ranks that import train.py .*line {refused_at}\)$"
    ):
        exec(run_script, vars(main))

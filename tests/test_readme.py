"""The README's usage examples run as written."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_examples_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    # torch_ref's example is run by parity_tests/test_torch_ref.py.
    blocks = [b for b in blocks if "import torch_ref" not in b]
    assert len(blocks) == 2
    script = tmp_path / "readme.py"
    # Checks appended after the README's own code, in the same namespace.
    script.write_text(
        "\n".join(blocks)
        + "\n".join(
            [
                "",
                "assert int(state.step) == 1, int(state.step)",
                "assert isinstance(trained, nnx.Sequential)",
                "print('nnx ok')",
            ]
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, timeout=300
    ).stdout.split()
    # 1024 rows over 4 ranks: 256 each, 8 steps of 2 x 16 per epoch; the fit
    # converges (the loss starts at E[(sum of 8 normals)^2] = 8).
    assert out[0] == "40"
    assert float(out[1]) < 0.1
    assert out[-2:] == ["nnx", "ok"]

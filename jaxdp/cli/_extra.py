"""The ``cli`` extra: what ``jaxdp train`` needs beyond jaxdp's own."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

# Module -> the distribution that installs it (pyproject.toml's `cli` extra).
CLI_EXTRA = {
    "sklearn": "scikit-learn",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
    "grain": "grain",
    "tensorboardX": "tensorboardX",
}


def require_extra(command: str, modules: Sequence[str]) -> None:
    """Exits with one line naming those of ``modules`` that are not installed.

    Looks them up without importing them, so a missing one costs no traceback.
    """
    missing = [CLI_EXTRA[module] for module in modules if not _installed(module)]
    if missing:
        raise SystemExit(
            f"jaxdp {command}: error: needs {', '.join(missing)} (the command line's extra): "
            "pip install 'jaxdp[cli]'"
        )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it; an imported one without spec
        return False

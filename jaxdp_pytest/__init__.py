"""jaxdp's pytest plugin (``-p no:jaxdp`` turns it off): ``@pytest.mark.devices(n)`` runs a
test with exactly ``n`` CPU devices, ``@pytest.mark.devices(n, processes=p)`` in ``p``
processes joined by JAX's distributed runtime. See docs/testing.md; the assertion helpers
are :mod:`jaxdp.testing`.

This module is what pytest loads at every start wherever jaxdp is installed, so it imports
neither JAX nor jaxdp: importing JAX reads its settings from the environment, and a
conftest.py that sets them (``JAX_PLATFORMS``, the compilation cache) must come first.
"""

from __future__ import annotations

import argparse
import pathlib

import pytest

from ._worker import set_device_count, settings_from_env, watch

MARKER = (
    "devices(n, processes=1): run the test with exactly n CPU devices in a worker process "
    "reused by every test with that mark (jaxdp.testing); with processes=p, in p processes "
    "joined by jax.distributed (p * n devices in all)"
)
# Read at import, before conftest files: a worker's count is set before anything else.
_WORKER = settings_from_env()
if _WORKER is not None:
    watch(_WORKER)
    set_device_count(_WORKER["devices"])


TIMEOUT_MARKER = (
    "timeout(seconds): pytest-timeout's mark, also honoured by jaxdp's plugin for devices "
    "tests: past it, their processes are named with their stacks and stopped"
)


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds >= 0 (0: none)")
    return seconds


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("jaxdp").addoption(
        "--jaxdp-timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="bound on each devices test (its worker processes): past it, each process "
        "still running is named with its threads' stacks and stopped (0: none; "
        "@pytest.mark.timeout wins; without this, pytest-timeout's --timeout if installed)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER)
    if not config.pluginmanager.has_plugin("timeout"):  # pytest-timeout registers its own
        config.addinivalue_line("markers", TIMEOUT_MARKER)
    if _WORKER is not None:
        from ._worker import Worker

        config.pluginmanager.register(Worker(_WORKER), "jaxdp-worker")
    elif not config.option.collectonly:
        from ._parent import Parent

        config.pluginmanager.register(Parent(config), "jaxdp-parent")


@pytest.fixture
def shared_tmp_path(request: pytest.FixtureRequest) -> pathlib.Path:
    """A directory every process of a ``devices(n, processes=p)`` test sees (each has its
    own ``tmp_path``); in a test run in one process, a fresh directory like ``tmp_path``."""
    worker = request.config.pluginmanager.get_plugin("jaxdp-worker")
    if worker is not None:
        return pathlib.Path(worker.shared)
    return request.getfixturevalue("tmp_path")

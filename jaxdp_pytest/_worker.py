"""The worker side: a pytest session started with a device count, running the tests the
parent sends and sending back their reports (one JAX start for all of them).

The parent starts ``python -m pytest FILES`` with ``JAXDP_TESTING_WORKER`` in the
environment (the spec, and two file descriptors: commands in, reports out). The session
collects FILES as any session would, sets the device count before the backend starts
(again after conftest files ran: a ``devices`` mark wins over a count they set), starts
JAX, and then runs the test the parent names, one at a time, on JSON lines.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import signal
import threading
import time
from typing import Any

import pytest

ENV = "JAXDP_TESTING_WORKER"
_FORCE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
# jaxdp.initialize's settings: read once at the start, then kept from what the tests run.
_RUNTIME_ENV = (
    "JAXDP_COORDINATOR_ADDRESS",
    "JAXDP_NUM_PROCESSES",
    "JAXDP_PROCESS_ID",
    "JAXDP_CPU_DEVICES",
    "JAXDP_TIMEOUT_S",
    "JAXDP_HEARTBEAT_TIMEOUT_S",
)


def set_device_count(devices: int) -> None:
    """The count for JAX's CPU backend, in both places it is read; a no-op once started."""
    import jax

    flags = _FORCE_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).split()
    os.environ["XLA_FLAGS"] = " ".join(
        [*flags, f"--xla_force_host_platform_device_count={devices}"]
    )
    with contextlib.suppress(RuntimeError):  # started already: start() reports its count
        jax.config.update("jax_num_cpu_devices", devices)


# The signal on which a worker writes every thread's stack to its stacks file (the
# parent's timeout sends it before stopping the worker).
STACKS_SIGNAL = signal.SIGUSR1
# How often a worker looks whether the pytest that started it is still there.
_PARENT_POLL_S = 0.1


def watch(settings: dict[str, Any]) -> None:
    """Sets a worker process up to be stopped from outside, at once, whatever its test does.

    faulthandler writes every thread's stack to the stacks file on :data:`STACKS_SIGNAL`
    (from C, so also while a test hangs in a collective or holds the GIL). A daemon
    thread ends the worker's whole process group (the worker leads its own, so a test's
    own child processes go too) as soon as its parent is gone, however that ended, a
    SIGKILL included: the worker is then reparented and ``getppid`` changes. Linux's
    ``PR_SET_PDEATHSIG`` would end the worker alone and leave a test's children behind.
    """
    stacks = open(settings["stacks"], "a")  # noqa: SIM115 (kept open for the handler)
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)
    parent = settings["parent"]

    def end_with_parent() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        group = os.getpgrp()
        if group == os.getpid():  # started in a session of its own, as the parent does
            os.killpg(group, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=end_with_parent, name="jaxdp-testing-parent", daemon=True).start()


class Worker:
    """The plugin of a worker session (registered instead of the parent's)."""

    def __init__(self, settings: dict[str, Any]):
        self.devices = settings["devices"]
        self.processes = settings["processes"]
        self.commands = os.fdopen(settings["commands"], "r")
        self.reports = os.fdopen(settings["reports"], "w")
        self.config: pytest.Config | None = None
        self.collect_errors: list[str] = []
        self.start_error: str | None = None
        self.shared: str | None = None
        set_device_count(self.devices)

    def send(self, **message: Any) -> None:
        self.reports.write(json.dumps(message, default=repr) + "\n")
        self.reports.flush()

    def pytest_configure(self, config: pytest.Config) -> None:
        self.config = config
        set_device_count(self.devices)  # after the initial conftest files

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors.append(f"{report.nodeid}: {report.longreprtext}")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        set_device_count(self.devices)  # after the test modules and their conftest files
        self.start_error = self.start()

    def start(self) -> str | None:
        """Starts JAX (and its distributed runtime); what went wrong, if anything."""
        import jax

        try:
            if self.processes > 1:
                import jaxdp
                from jaxdp._quiet_gloo import quiet_gloo_notes

                jaxdp.initialize()
                quiet_gloo_notes()  # the worker's own process: gloo's note stays out of its log
            devices = jax.local_devices()
        except Exception as e:  # reported with every test of this worker
            return f"JAX did not start: {type(e).__name__}: {e}"
        finally:
            for name in _RUNTIME_ENV:
                os.environ.pop(name, None)
        found = f"{len(devices)} {devices[0].platform} device(s)"
        if len(devices) != self.devices or devices[0].platform != "cpu":
            return (
                f"JAX started with {found}, not {self.devices} cpu device(s): something "
                "(a conftest.py or test module) started its backend while being imported, "
                "before the count could be set; start it in a fixture instead"
            )
        return None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        items = {item.nodeid: item for item in session.items}
        self.send(ready={"pid": os.getpid(), "error": self.start_error})
        for line in self.commands:
            command = json.loads(line)
            item, nextitem = items.get(command["run"]), items.get(command["next"] or "")
            self.shared = command["shared"]
            if self.start_error or item is None:
                found = f"{len(items)} test(s)" + "".join(f"\n{e}" for e in self.collect_errors)
                self.send(missing=self.start_error or f"the worker collected {found}")
            else:
                item.ihook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            self.send(done=command["run"])
        return True

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        self.send(report=data)


def settings_from_env() -> dict[str, Any] | None:
    """The worker's settings, taken out of the environment (tests must not inherit them)."""
    text = os.environ.pop(ENV, None)
    return json.loads(text) if text else None


def main_environment(settings: dict[str, Any]) -> dict[str, str]:
    """The environment of a worker process, from this one's."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", *_RUNTIME_ENV)}
    env[ENV] = json.dumps(settings)
    env["JAX_PLATFORMS"] = "cpu"  # CPU devices, on a machine with GPUs too
    env["PYTHONUNBUFFERED"] = "1"  # a crash loses no output
    return env

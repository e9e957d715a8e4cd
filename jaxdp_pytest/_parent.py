"""The parent side's hooks: tests marked ``devices`` run in their group's processes and
their reports are logged here as this session's own; all other tests run here."""

from __future__ import annotations

import pathlib
import shutil
import tempfile
from typing import Any

import pytest

# The one function of pytest's own that this plugin calls: pytest's default protocol,
# with the next test that runs *here* (a marked one in between runs elsewhere).
from _pytest.runner import runtestprotocol

from ._group import Group, Outcome, worker_argv
from ._spec import Spec, spec_of

PHASES = ("setup", "call", "teardown")


class Parent:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.groups: dict[Spec, Group] = {}
        self.order: dict[int, int] = {}
        self.items: list[pytest.Item] = []
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="pytest-jaxdp-"))
        # Under pytest-xdist only the next test of this worker is known, not the one after.
        self.sequential = not hasattr(config, "workerinput")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.items = list(session.items)
        self.order = {id(item): i for i, item in enumerate(self.items)}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        try:
            spec = spec_of(item)
            timeout = timeout_of(item) if spec is not None else None
        except ValueError as e:
            self.log(item, [failed(item, "setup", str(e))])
            return True
        if spec is None:
            if nextitem is None or _spec_or_error(nextitem) is None:
                return None  # pytest's own protocol, unchanged
            ihook = item.ihook
            ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
            runtestprotocol(item, nextitem=self.next_like(item, nextitem, None))
            ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
            return True
        # pytest-timeout's timer (set around this hook) would fire here, outside any test
        # phase; the bound is kept by ``run`` instead, through its public hook.
        cancel = getattr(item.config.hook, "pytest_timeout_cancel_timer", None)
        if cancel is not None:
            cancel(item=item)
        self.log(item, self.run(item, spec, self.next_like(item, nextitem, spec), timeout))
        return True

    def next_like(
        self, item: pytest.Item, nextitem: pytest.Item | None, spec: Spec | None
    ) -> pytest.Item | None:
        """The next test to run where ``item`` runs (here for spec None): what decides
        which module and session fixtures its teardown keeps."""
        if nextitem is None or _spec_or_error(nextitem) == spec:
            return nextitem
        if not self.sequential or id(item) not in self.order:
            return None  # unknown: tear everything down, set it up again when needed
        later = self.items[self.order[id(item)] + 1 :]
        return next((i for i in later if _spec_or_error(i) == spec), None)

    def run(
        self,
        item: pytest.Item,
        spec: Spec,
        nextitem: pytest.Item | None,
        timeout: tuple[float, str] | None,
    ) -> list[Any]:
        group = self.groups.get(spec)
        if group is None:
            files = sorted({str(i.path) for i in self.items if _spec_or_error(i) == spec})
            argv = worker_argv(self.config, files or [str(item.path)])
            cwd = str(self.config.invocation_params.dir)
            group = self.groups[spec] = Group(spec, argv, cwd, self.root)
        shared = pathlib.Path(tempfile.mkdtemp(prefix=item.name[:30] + "-", dir=self.root))
        nextid = nextitem.nodeid if nextitem else None
        outcomes = group.run(item.nodeid, nextid, str(shared), timeout)
        return merged(self.config, item, spec, outcomes)

    def log(self, item: pytest.Item, reports: list[pytest.TestReport]) -> None:
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for report in reports:
            ihook.pytest_runtest_logreport(report=report)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)

    def pytest_sessionfinish(self) -> None:
        for group in self.groups.values():
            group.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def timeout_of(item: pytest.Item) -> tuple[float, str] | None:
    """The seconds a ``devices`` test may run, and where they were set: pytest-timeout's
    ``@pytest.mark.timeout(s)`` (closest first), else ``--jaxdp-timeout``, else
    pytest-timeout's ``--timeout`` when it is installed; None (0 too): no bound.

    Raises:
      ValueError: the value is not a number >= 0, named with where it was set.
    """
    mark = item.get_closest_marker("timeout")
    option = item.config.option
    if mark is not None:
        value = mark.args[0] if mark.args else mark.kwargs.get("timeout")
        where = f"@pytest.mark.timeout({value!r})"
    elif getattr(option, "jaxdp_timeout", None) is not None:
        value, where = option.jaxdp_timeout, f"--jaxdp-timeout={option.jaxdp_timeout}"
    else:
        value = getattr(option, "timeout", None)  # pytest-timeout's, when installed
        where = f"--timeout={value}"
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds >= 0:  # NaN too
        raise ValueError(f"{where}: the timeout must be a number of seconds >= 0 (0: none)")
    return (seconds, where) if seconds > 0 else None


def _spec_or_error(item: pytest.Item) -> Spec | None | str:
    try:
        return spec_of(item)
    except ValueError as e:
        return str(e)


def failed(item: pytest.Item, when: str, text: str) -> pytest.TestReport:
    keywords = {k: 1 for k in item.keywords}
    return pytest.TestReport(item.nodeid, item.location, keywords, "failed", text, when)


def merged(
    config: pytest.Config, item: pytest.Item, spec: Spec, outcomes: list[Outcome]
) -> list[pytest.TestReport]:
    """One report per phase from every process's reports: failed if one failed, the
    first failure's traceback shown with each process named; then the abnormal end of a
    process, if one ended, as a failure of the phase it did not finish."""
    count = len(outcomes)
    name = (lambda r: f"process {r} of {count}") if count > 1 else (lambda r: "the worker")
    reports = [[_report(config, data) for data in o.reports] for o in outcomes]
    out: list[pytest.TestReport] = []
    cut = False  # a process ended before this phase's report: nothing after it counts
    for when in PHASES:
        phase = [(r, rep) for r, reps in enumerate(reports) for rep in reps if rep.when == when]
        if not phase:
            break
        out.append(_merge_phase(phase, count, name))
        cut = any(o.ended and r not in {r for r, _ in phase} for r, o in enumerate(outcomes))
        if cut:
            break
    ended = [(r, o) for r, o in enumerate(outcomes) if o.ended or o.missing]
    if not ended:
        return out
    lines = []
    for r, o in ended:
        what = o.missing or f"{name(r)} for {spec} (pid {o.pid}) {o.ended}"
        lines.append(f"jaxdp.testing: {what} while running {item.nodeid}")
        lines.append(f"---- its output since the test started ----\n{o.output}")
        if o.stacks:
            lines.append(f"---- where its threads were when it was stopped ----\n{o.stacks}")
    if any(o.ended for _, o in ended):
        lines.append("The next test of this spec starts new processes.")
    if cut:
        _fail_with(out[-1], "\n".join(lines))
    else:
        out.append(failed(item, PHASES[min(len(out), 2)], "\n".join(lines)))
    return out


def _fail_with(report: pytest.TestReport, text: str) -> None:
    report.outcome = "failed"
    if hasattr(report.longrepr, "addsection"):
        report.longrepr.addsection("jaxdp.testing", text)
    else:
        report.longrepr = "\n".join(str(x) for x in (report.longrepr, text) if x)


def _report(config: pytest.Config, data: dict[str, Any]) -> pytest.TestReport:
    report = config.hook.pytest_report_from_serializable(config=config, data=data)
    # JSON made lists of the tuples that pytest's reporters unpack.
    report.location = tuple(report.location)
    if isinstance(report.longrepr, list):
        report.longrepr = tuple(report.longrepr)
    return report


def _merge_phase(phase: list[tuple[int, Any]], count: int, name: Any) -> Any:
    if count == 1:
        return phase[0][1]
    bad = [(r, rep) for r, rep in phase if rep.failed]
    first = bad[0][1] if bad else phase[0][1]
    sections = []
    for r, rep in phase:
        sections += [(f"{title} ({name(r)})", text) for title, text in rep.sections]
    first.sections = sections
    first.duration = max(rep.duration for _, rep in phase)
    if bad:
        summary = ", ".join(f"{name(r)} {'failed' if rep.failed else 'passed'}" for r, rep in phase)
        note = f"jaxdp.testing: {summary}; the traceback above is {name(bad[0][0])}'s"
        others = [f"---- {name(r)} ----\n{rep.longreprtext}" for r, rep in bad[1:]]
        _fail_with(first, "\n".join([note, *others]))
    return first

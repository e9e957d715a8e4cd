"""What a ``devices`` mark asks for, checked: a device count per process and a process count."""

from __future__ import annotations

import dataclasses

import pytest

# XLA's CPU client starts 512 emulated devices in about 2 s; 4096 took 14 s and 0.6 GB
# (measured, 2 cores), which no test of sharded code needs.
MAX_DEVICES = 512
# Each process is a Python with JAX (about 0.3 GB); more than this is a cluster, not a test.
MAX_PROCESSES = 16


@dataclasses.dataclass(frozen=True)
class Spec:
    """``devices`` CPU devices in each of ``processes`` processes (one process: no runtime)."""

    devices: int
    processes: int = 1

    def __str__(self) -> str:
        if self.processes == 1:
            return f"devices({self.devices})"
        return f"devices({self.devices}, processes={self.processes})"


def spec_of(item: pytest.Item) -> Spec | None:
    """The item's ``devices`` mark, checked (the closest one wins); None without one.

    Raises:
      ValueError: the mark's arguments break a rule, named with their values.
    """
    mark = item.get_closest_marker("devices")
    if mark is None:
        return None
    args, kwargs = mark.args, dict(mark.kwargs)
    shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
    where = f"@pytest.mark.devices({shown})"
    if not args:
        raise ValueError(
            f"{where} needs the device count of each process: devices(n) or devices(n, processes=p)"
        )
    if len(args) > 1 or set(kwargs) - {"processes"}:
        raise ValueError(f"{where}: the arguments are devices(n) or devices(n, processes=p)")
    processes = kwargs.get("processes", 1)
    for name, value, limit in (
        ("n", args[0], MAX_DEVICES),
        ("processes", processes, MAX_PROCESSES),
    ):
        if type(value) is not int or value < 1:
            raise ValueError(f"{where}: {name}={value!r} must be a positive integer")
        if value > limit:
            raise ValueError(f"{where}: {name}={value} exceeds the {limit} this plugin starts")
    return Spec(args[0], processes)

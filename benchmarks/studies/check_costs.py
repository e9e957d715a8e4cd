"""What jaxdp's data checks cost, measured through the functions that run them.

Run from the repository root (about half a minute on 2 cores)::

    .venv/bin/python benchmarks/studies/check_costs.py             # 5 repeats, the median
    .venv/bin/python benchmarks/studies/check_costs.py --repeats 9

- the data digest (``jaxdp/data/_fingerprint.py``): SHA-256 of every byte of a
  memmapped field, as a loader hashes one of at most 256 MiB, here over a 512 MiB
  ``.npy`` file just written (so in the page cache: the hashing, not the disk);
  seconds per GB (10**9 bytes); and the whole fingerprint of that file, which at
  512 MiB hashes 1,024 sampled rows; and hashlib's SHA-256, BLAKE2b and MD5 alone
  over the same bytes in memory (why SHA-256);
- the NaN/Inf scan of ``jaxdp train --data`` (``jaxdp/cli/_data.py``) over a
  100 MB float32 ``x`` in memory; seconds per 100 MB;
- the watch of a memmap's file before each read (``check_files``: one ``os.stat``
  per file), over one file; microseconds per call;
- the digest of a record-by-record source, every record of 20,000 (16 float32
  and an integer label each), as a plain object with ``__getitem__`` and as a
  grain ``MapDataset`` (read by its batched ``_getitems``); microseconds per record.

Prints the machine (CPU model, core count), then each figure as the median of the
repeats with their range. docs/data.md, docs/command-line.md, docs/decisions.md and
the modules' docstrings quote them.
"""

import argparse
import hashlib
import os
import pathlib
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np

from jaxdp.cli._data import _check_finite
from jaxdp.data._fingerprint import (
    _hash_field,
    check_files,
    fingerprint,
    memmapped_files,
    records_fingerprint,
)
from jaxdp.data._kinds import batched_records

GB = 10**9
DIGEST_BYTES = 512 * 2**20
SCAN_BYTES = 100 * 10**6
STAT_CALLS = 20_000
RECORDS = 20_000


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after one call to warm it."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def say(what: str, times: list[float], scale: float, unit: str) -> None:
    values = sorted(t * scale for t in times)
    print(
        f"{what}: {statistics.median(values):.3g} {unit} "
        f"(median of {len(values)}; {values[0]:.3g} to {values[-1]:.3g})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each (default: 5)")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp, "x.npy")
        rows = DIGEST_BYTES // (256 * 4)
        np.save(path, rng.standard_normal((rows, 256), dtype=np.float32))
        x = np.load(path, mmap_mode="r")
        assert x.nbytes == DIGEST_BYTES
        # The loader's pass over a field it hashes whole (rows=None: every byte).
        whole = timed(lambda: _hash_field(hashlib.sha256(), x, len(x), None), args.repeats)
        say("SHA-256 digest of every byte (512 MiB memmap)", whole, GB / x.nbytes, "s per GB")
        sampled = timed(lambda: fingerprint({"x": x}, len(x)), args.repeats)
        covers = fingerprint({"x": x}, len(x))["covers"]
        say(f"fingerprint of the 512 MiB memmap ({covers})", sampled, 1e3, "ms")
        data = np.asarray(x).tobytes()
        for name in ("sha256", "blake2b", "md5"):
            alone = timed(lambda name=name: hashlib.new(name, data).digest(), args.repeats)
            say(f"hashlib.{name} alone (bytes in memory)", alone, GB / len(data), "s per GB")

        files = memmapped_files({"x": x})
        per_stat = timed(lambda: [check_files(files) for _ in range(STAT_CALLS)], args.repeats)
        say("os.stat watch of one memmapped file", per_stat, 1e6 / STAT_CALLS, "us per read")
        del x

    x = rng.standard_normal((SCAN_BYTES // (64 * 4), 64), dtype=np.float32)
    scan = timed(lambda: _check_finite("x", x), args.repeats)
    say("NaN/Inf scan of x (float32, in memory)", scan, 100 * 10**6 / x.nbytes, "s per 100 MB")
    record_digests(args.repeats)


class Records:
    """A record source of a team's own: ``__len__`` and ``__getitem__``."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"x": self.x[i], "y": self.y[i]}


def record_digests(repeats: int) -> None:
    """The fingerprint of every record of a small record source, two ways of reading it."""
    import grain

    rng = np.random.default_rng(0)
    plain = Records(rng.standard_normal((RECORDS, 16), dtype=np.float32), np.arange(RECORDS))
    dataset = grain.MapDataset.source(plain)
    for name, source, batched in [
        ("a plain record source", plain, None),
        ("a grain MapDataset", dataset, batched_records(dataset)),
    ]:
        covers = records_fingerprint(source, RECORDS, batched=batched)["covers"]
        assert covers == "every record", covers
        digest = timed(
            lambda s=source, b=batched: records_fingerprint(s, RECORDS, batched=b), repeats
        )
        say(f"fingerprint of {name} ({covers})", digest, 1e6 / RECORDS, "us per record")


if __name__ == "__main__":
    main()

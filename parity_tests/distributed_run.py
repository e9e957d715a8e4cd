"""One jaxdp parity run as several processes; parity_tests/test_distributed_parity.py starts it.

    jaxdp launch --nprocs 2 --devices-per-process 2 -- parity_tests/distributed_run.py IN OUT

IN (.npz, written by the test): the data ``x``, ``y``, the initial torch
state_dict under ``init/<name>`` and torch's sampler orders under
``perm/<seed>``, so no process imports torch. Each process trains the
``cells.MULTI_PROCESS`` configuration on both accumulation paths, and at
ZeRO stages 1 and 2 (``RUNS``), reading the data through counters, and writes
OUT/process<p>.npz: the dataset rows it read, and (every process) the weights
after every step of each run.
"""

import pathlib
import sys

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_default_matmul_precision", "highest")

import jaxdp  # noqa: E402  (jax's config first: x64 must be set before any array)

jaxdp.initialize()  # reads the JAXDP_* environment jaxdp launch sets

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402
from cells import MULTI_PROCESS  # noqa: E402

from jaxdp.parity import run_jaxdp  # noqa: E402

# (label, path, zero_stage): stage 0 on both paths, and each ZeRO stage on one path.
RUNS = (
    ("fused", "fused", 0),
    ("multisteps", "multisteps", 0),
    ("fused-zero2", "fused", 2),
    ("multisteps-zero1", "multisteps", 1),
)


class Counting:
    """An array that records the rows read from it."""

    def __init__(self, array):
        self.array, self.read = array, []

    def __getitem__(self, rows):
        self.read.append(np.asarray(rows).ravel())
        return self.array[rows]


def main(inputs: str, out: str) -> None:
    given = np.load(inputs)
    initial = {k.removeprefix("init/"): given[k] for k in given.files if k.startswith("init/")}
    orders = {int(k.removeprefix("perm/")): given[k] for k in given.files if k.startswith("perm/")}
    record = {
        "process_count": jax.process_count(),
        "local_devices": len(jax.local_devices()),
        "devices": jax.device_count(),
    }
    for label, path, stage in RUNS:
        x, y = Counting(given["x"]), Counting(given["y"])
        config = dataclasses.replace(MULTI_PROCESS, path=path)
        options = {"parallel": jaxdp.Parallel(zero_stage=stage)} if stage else {}
        run = run_jaxdp(
            config, (x, y), initial, permutation=lambda n, seed: orders[seed], **options
        )
        record[f"{label}/rows"] = np.concatenate(x.read)
        assert np.array_equal(record[f"{label}/rows"], np.concatenate(y.read))
        for i, state in enumerate(run.states):
            record.update({f"{label}/{i}/{k}": v for k, v in state.items()})
        record[f"{label}/losses"] = np.array(run.losses)
    np.savez(pathlib.Path(out) / f"process{jax.process_index()}.npz", **record)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""The data-parallel loader: each process's rows of every call, in DistributedSampler order.

Call ``c`` of a run (a global batch on the ``fused`` path, a global micro-batch on
``multisteps``) is a pure function of ``c``: epoch, optimizer step in the epoch
and micro-batch follow from it, and its rows from :func:`jaxdp.epoch_schedule`.
So reading runs ahead on worker threads in any order of completion, a resume
needs only the position, and every process reads its own rows without talking
to the others.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, get_args

import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._checks import is_integer
from .._layout import (
    BatchSizes,
    EpochSchedule,
    LastWindow,
    batch_sizes,
    epoch_schedule,
    process_share,
)
from .._mesh import DATA_AXIS, place
from .._position import SamplerPosition, resume_position
from .._sampler import Permutation, numpy_permutation
from ._fingerprint import difference
from ._prefetch import Placed, read_ahead
from ._source import Source, Transform
from ._stream import Stream, everyone, gathered, is_stream

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from .._step import TrainStep


class Batch(NamedTuple):
    """One call of the step, as :class:`Loader` yields it: ``step(state, batch)`` (the step
    checks ``sizes`` and ``path`` against its own), or ``step(state, *batch[:2])``."""

    data: Any  # the call's rows of every process, on the mesh (jax.Arrays split by rows)
    micro_weights: np.ndarray  # fused: [accum_steps]; multisteps: a scalar; 0 marks padding
    epoch: int
    position: SamplerPosition  # the next data after this call
    emits: bool  # the call ends an optimizer step (every call on the fused path)
    sizes: BatchSizes  # the loader's global batch identity
    path: str  # the loader's path: "fused" or "multisteps"


# What a restore must find equal: another value changes which rows a position names.
_ORDER = ("dataset_size", "shuffle", "seed", "drop_last", "last_window")
# The peak memory of building one epoch's order (jaxdp.epoch_schedule: DistributedSampler's
# int64 permutation, each rank's share, the stacked calls): measured 89-90 bytes per record
# (10**7 and 3 * 10**7 records, 1 device, ru_maxrss); rounded up.
ORDER_BYTES_PER_RECORD = 96


def _check_order_fits(records: int) -> None:
    """Refuses, before allocating it, an epoch order larger than this machine's memory (a
    source declaring 10**12 records failed in numpy naming 7.28 TiB and not the source;
    10**9 grew the process until the kernel killed it)."""
    need = records * ORDER_BYTES_PER_RECORD
    have = _physical_memory()
    if have is not None and need > have:
        raise ValueError(
            f"source has {records} records: the loader's order of one epoch (DistributedSampler's "
            f"permutation, int64, about {ORDER_BYTES_PER_RECORD} bytes per record at its peak) "
            f"needs about {_bytes(need)}, more than the {_bytes(have)} of memory here; "
            "check the source's __len__, or split the data into smaller sources"
        )


def _physical_memory() -> int | None:
    """The machine's memory, or the container's limit where one is set (cgroup v2)."""
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: no check
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
    except OSError:
        return have
    return min(have, int(limit)) if limit.isdigit() else have


def _bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _check_stream_options(
    shuffle: bool | None,
    seed: int,
    drop_last: bool | None,
    permutation: Permutation,
    last_window: LastWindow,
) -> None:
    """Refuses an option of the loader's own order given for a stream, which orders itself."""
    given = {
        "shuffle": shuffle is not None,
        "seed": seed != 0,
        "drop_last": drop_last is False,
        "permutation": permutation is not numpy_permutation,
        "last_window": last_window != "drop",
    }
    named = [name for name, set_ in given.items() if set_]
    if named:
        raise ValueError(
            f"{named[0]}= is for a random-access source; a stream (an iterable source) is read "
            "in its own order, each process's shard from its start, and the tail of a pass "
            "that fills no optimizer step on every process is dropped: shuffle it in its "
            "library (grain: MapDataset.shuffle(seed) before to_iter_dataset(); Hugging Face: "
            "IterableDataset.shuffle(seed=, buffer_size=), reshuffled by epoch)"
        )


class Loader:
    """This process's rows of every call of a data-parallel step, placed on the mesh.

    Build it from the step, ``Loader.for_step(step, source, micro_batch_size=...)``
    (its mesh, path and split taken from the step), or give them:
    ``Loader(source, sizes, mesh=step.mesh, path=step.path)``; either way
    ``step(state, batch)`` checks the batch's path and split against its own at
    every call, naming both.

    Yields :class:`Batch` es: on the ``fused`` path one per optimizer step (the
    process's rows of the global batch, device-major), on ``multisteps`` one per
    global micro-batch (``accum_steps`` per step). The rows are exactly
    :func:`jaxdp.epoch_schedule`'s (DistributedSampler's order, one rank per
    mesh device) for the same ``shuffle``, ``seed``, ``drop_last``,
    ``permutation`` and ``last_window``; a process reads only the rows of its
    own devices (:func:`jaxdp.process_share`). ``workers`` threads read and
    collate calls ahead (grain), and a further thread places them on the mesh
    (``jax.make_array_from_process_local_data``), at most ``prefetch`` placed
    calls ahead of the loop.

    A stream (an iterable without random access: a grain ``IterDataset``, a Hugging
    Face streaming ``IterableDataset``, any iterable that starts over when iterated) is
    this process's own shard: each call takes its next records in the stream's order,
    an epoch is one pass, ended for every process at the first step some process's
    shard cannot fill (one small all-gather per step under several processes), and the
    position carries each process's state of its stream (:mod:`jaxdp.data._stream`);
    ``shuffle``, ``seed``, ``drop_last``, ``permutation`` and ``last_window`` are for a
    random-access source (None: ``shuffle=True``, ``drop_last=False`` there) and are
    refused for a stream.

    Iteration starts at :attr:`position` and runs ``epochs`` epochs from the
    start of training (None: endlessly); :attr:`position` and :attr:`samples`
    follow what the loop has been given, so breaking out and iterating again
    continues with the next call. :meth:`state` and :meth:`restore` save and
    set them; ``jaxdp.checkpoint.Checkpoints.save(state, data=loader)`` and
    ``restore(like, data=loader)`` do it with the checkpoint.

    Raises ``ValueError`` or ``TypeError`` at construction for a bad source
    (empty, fields of different lengths, neither random access nor iterable, an
    iterator, a random-access option given for a stream, a field or Hugging
    Face column of text, more records than one epoch's order fits in this
    machine's memory), one epoch that
    cannot fill an optimizer step, and an option out of its range; a read or
    a ``transform`` that raises is raised by the loop at that call (a
    transform's error names the record), a worker that dies as
    :class:`LoaderWorkerError`; with ``read_timeout_s``, a wait for a batch
    longer than that as :class:`LoaderTimeoutError`, naming the record whose
    read has not returned.

    Each iteration reads on background threads until it ends, is garbage
    collected, or :meth:`close` is called: ``with Loader(...) as loader:``
    closes on leaving the block, and an iterator still held then ends
    (``StopIteration``). Breaking out of a ``for`` loop, or Ctrl-C while it
    waits for a batch (even on a read that never returns), ends that iteration
    at once; a loop left unclosed is closed at interpreter exit.
    """

    def __init__(
        self,
        source: Any,
        sizes: BatchSizes,
        *,
        mesh: Mesh,
        path: Literal["fused", "multisteps"] = "fused",
        transform: Transform | None = None,
        shuffle: bool | None = None,
        seed: int = 0,
        drop_last: bool | None = None,
        permutation: Permutation = numpy_permutation,
        last_window: LastWindow = "drop",
        epochs: int | None = None,
        workers: int = 4,
        prefetch: int = 2,
        read_timeout_s: float | None = None,
    ) -> None:
        if path not in ("fused", "multisteps"):
            raise ValueError(f"path={path!r} must be 'fused' or 'multisteps'")
        for name, value in (("workers", workers), ("prefetch", prefetch)):
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if read_timeout_s is not None and not (
            isinstance(read_timeout_s, int | float) and read_timeout_s > 0
        ):
            raise ValueError(f"read_timeout_s={read_timeout_s!r} must be a number > 0 or None")
        self.read_timeout_s = read_timeout_s
        if epochs is not None and (not is_integer(epochs) or epochs < 1):
            raise ValueError(f"epochs={epochs!r} must be a positive integer or None (endless)")
        if last_window not in get_args(LastWindow):  # before the source, and its rows' error
            raise ValueError(f"last_window={last_window!r} must be 'drop' or 'step'")
        if not is_integer(seed) or seed < 0:  # before the schedule, whose error says rows
            raise ValueError(f"seed={seed!r} must be a non-negative integer")
        self.sizes, self.mesh, self.path = sizes, mesh, path
        self.share = process_share(mesh, sizes)
        self.permutation = permutation
        self.epochs, self.workers, self.prefetch = epochs, workers, prefetch
        self.calls_per_step = 1 if path == "fused" else sizes.accum_steps
        self.stream: Stream | None = None
        self._stream_state: Any = None  # the stream's own state after the last call given
        if is_stream(source):
            _check_stream_options(shuffle, seed, drop_last, permutation, last_window)
            self.stream, self.source = Stream(source, transform), None
            self.order = {"stream": self.stream.kind, "processes": self.share.process_count}
            self.steps_per_epoch = None  # a pass ends where its shard does
        else:
            self._random_access(source, transform, shuffle, seed, drop_last, last_window)
        self.position = SamplerPosition(0, 0, 0)
        self.samples = 0  # rows of weight > 0 given to the loop, all processes
        self._sharding = NamedSharding(mesh, P(DATA_AXIS))
        self._iterations: weakref.WeakSet[Placed] = weakref.WeakSet()

    def _random_access(
        self,
        source: Any,
        transform: Transform | None,
        shuffle: bool | None,
        seed: int,
        drop_last: bool | None,
        last_window: LastWindow,
    ) -> None:
        self.source = Source(source, transform)
        _check_order_fits(len(self.source))
        self.order = {
            "dataset_size": len(self.source),
            "shuffle": shuffle is None or bool(shuffle),
            "seed": seed,
            "drop_last": bool(drop_last),
            "last_window": last_window,
        }
        # The workers read calls of at most two epochs at a time.
        self._schedule = functools.lru_cache(maxsize=2)(self._build_schedule)
        try:
            self.steps_per_epoch = len(self._schedule(0).rows)
        except ValueError as e:
            raise ValueError(
                f"source has {len(self.source)} rows, too few for one optimizer step of "
                f"{self.sizes.describe()}: {e}"
            ) from None

    @classmethod
    def for_step(
        cls,
        step: TrainStep,
        source: Any,
        *,
        micro_batch_size: int | None = None,
        global_batch_size: int | None = None,
        **options: Any,
    ) -> Loader:
        """A loader for ``step``'s calls: its mesh, path, ``num_devices`` and
        ``accum_steps`` taken from the step, and one of ``micro_batch_size`` (rows per
        device per micro-batch) or ``global_batch_size`` (rows per optimizer step, all
        processes). ``options`` are the constructor's (``seed``, ``epochs``, ...).

        Raises ``ValueError`` as :func:`jaxdp.batch_sizes` does (neither size,
        both inconsistent, a global batch that does not divide by
        ``num_devices * accum_steps``), and ``TypeError`` for an option that the
        step decides (``sizes``, ``mesh``, ``path``).
        """
        taken = sorted({"sizes", "mesh", "path"} & set(options))
        if taken:
            raise TypeError(
                f"Loader.for_step takes {', '.join(taken)} from the step (path="
                f"{step.path!r}, num_devices={step.num_devices}, accum_steps="
                f"{step.accum_steps}); pass micro_batch_size or global_batch_size only"
            )
        sizes = batch_sizes(
            num_devices=step.num_devices,
            accum_steps=step.accum_steps,
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
        )
        return cls(source, sizes, mesh=step.mesh, path=step.path, **options)

    # ---- the order ------------------------------------------------------------------

    def _build_schedule(self, epoch: int) -> EpochSchedule:
        order = {k: v for k, v in self.order.items() if k != "dataset_size"}
        return epoch_schedule(
            len(self.source), self.sizes, epoch=epoch, permutation=self.permutation, **order
        )

    def _call_index(self, position: SamplerPosition) -> int:
        epoch, step, micro = position
        return (epoch * self.steps_per_epoch + step) * self.calls_per_step + micro

    def _position(self, call: int) -> SamplerPosition:
        epoch, rest = divmod(call, self.steps_per_epoch * self.calls_per_step)
        return SamplerPosition(epoch, *divmod(rest, self.calls_per_step))

    def rows(self, position: SamplerPosition) -> tuple[np.ndarray, np.ndarray]:
        """This process's dataset indices of the call at ``position``, and its micro-weights."""
        if self.stream is not None:
            raise ValueError(
                f"the loader's source is a stream ({self.stream.name}): its rows are the "
                "next records of each process's shard, not indices of a data set"
            )
        epoch, step, micro = position
        schedule = self._schedule(epoch)
        mine = schedule.rows[step][self.share.rows]
        if self.path == "fused":
            return mine, schedule.micro_weights[step]
        local = self.share.sizes
        per_device = mine.reshape(local.num_devices, local.accum_steps, local.micro_batch_size)
        return per_device[:, micro].reshape(-1), schedule.micro_weights[step, micro]

    def _read(self, call: int) -> tuple[Any, np.ndarray, SamplerPosition]:
        position = self._position(call)
        rows, weights = self.rows(position)
        return self.source.read(rows), weights, position

    # ---- iteration ------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        if self.stream is not None:
            yield from self._streamed()
            return
        start = self._call_index(self.position)
        per_epoch = self.steps_per_epoch * self.calls_per_step
        stop = sys.maxsize if self.epochs is None else self.epochs * per_epoch
        if start >= stop:
            return
        closed = threading.Event()
        calls = read_ahead(self._read, start, stop, workers=self.workers, closed=closed)
        placed = Placed(
            calls,
            self._place,
            depth=self.prefetch,
            timeout=self.read_timeout_s,
            stuck=self.source.stuck,
            stop=closed,
        )
        self._iterations.add(placed)
        rows_per_micro = self.sizes.num_devices * self.sizes.micro_batch_size
        try:
            for data, weights, at in placed:
                after = self._position(self._call_index(at) + 1)
                self.position, self.samples = (
                    after,
                    self.samples + int(np.count_nonzero(weights) * rows_per_micro),
                )
                emits = at.micro_batch + 1 == self.calls_per_step
                yield Batch(data, weights, at.epoch, after, emits, self.sizes, self.path)
        finally:
            placed.close()

    def _streamed(self) -> Iterator[Batch]:
        """A stream's calls: one pass over this process's shard per epoch, read and placed on
        one thread (the stream reads in order), one optimizer step's calls at a time. Under
        several processes every process agrees that each has the step's rows before any
        yields it (one small all-gather per step): a shard that ends first ends the epoch
        for all, so no process waits in the step for one that has nothing to give."""
        assert self.stream is not None
        rows_per_micro = self.sizes.num_devices * self.sizes.micro_batch_size
        while self.epochs is None or self.position.epoch < self.epochs:
            epoch, step, micro = self.position
            start = step * self.calls_per_step + micro  # calls into the epoch's pass
            placed = Placed(
                self._steps_read(epoch, start, self._stream_state),
                self._place_step,
                depth=self.prefetch,
                timeout=self.read_timeout_s,
                stuck=self.stream.stuck,
            )
            self._iterations.add(placed)
            try:
                given = start
                while True:
                    try:
                        calls = next(placed)
                    except StopIteration:  # closed: the position stays
                        return
                    if not everyone(calls is not None):
                        break
                    for data, weights, at, state in calls:
                        given += 1
                        after = self._stream_position(epoch, given)
                        self.position, self._stream_state = after, state
                        self.samples += int(np.count_nonzero(weights) * rows_per_micro)
                        emits = at.micro_batch + 1 == self.calls_per_step
                        yield Batch(data, weights, at.epoch, after, emits, self.sizes, self.path)
            finally:
                placed.close()
            if given == 0:
                raise ValueError(
                    f"epoch {epoch} of the {self.stream.name} gave no optimizer step of "
                    f"{self.sizes.describe()} on every process: a pass over a process's shard "
                    f"has fewer than {self.share.sizes.global_batch_size} records (the rows of "
                    "this process's devices for one step)"
                )
            self.position, self._stream_state = SamplerPosition(epoch + 1, 0, 0), None

    def _steps_read(self, epoch: int, start: int, state: Any) -> Iterator[list[Any] | None]:
        """The rest of each optimizer step's calls from call ``start`` of ``epoch``'s pass
        (at the stream's ``state``), each call with its position and the stream's state
        after it; None once the pass has too few records left for a step (its tail)."""
        assert self.stream is not None
        local = self.share.sizes
        per_call = local.global_batch_size // self.calls_per_step  # this process's rows
        skip = 0 if state is not None or self.stream.kind != "none" else start * per_call
        reading = self.stream.passes(epoch, state, skip)
        weights = (
            np.ones(self.sizes.accum_steps, np.float32) if self.path == "fused" else np.float32(1)
        )
        call = start
        while True:
            calls = []
            for _ in range(self.calls_per_step - call % self.calls_per_step):
                batch = reading.take(per_call)
                if batch is None:
                    yield None
                    return
                calls.append((batch, weights, self._stream_position(epoch, call), reading.state()))
                call += 1
            yield calls

    def _stream_position(self, epoch: int, call: int) -> SamplerPosition:
        return SamplerPosition(epoch, *divmod(call, self.calls_per_step))

    def _place_step(self, calls: list[Any] | None) -> list[Any] | None:
        if calls is None:
            return None
        return [(place(data, self._sharding), *rest) for data, *rest in calls]

    def close(self) -> None:
        """Stops every iteration's background threads and waits for them.

        The position stays where the loop left it: iterating again continues
        with the next call. Called by ``with`` on leaving the block.
        """
        for placed in list(self._iterations):
            placed.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _place(self, item: tuple[Any, np.ndarray, SamplerPosition]) -> Any:
        data, weights, position = item
        return place(data, self._sharding), weights, position

    # ---- position -------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The position and what it means, as JSON: restore it with :meth:`restore`.

        A stream's holds every process's own state of its stream (grain's iterator
        state, a Hugging Face ``state_dict()``; None for a stream without one), in process
        order: under several processes a collective (two small all-gathers), so call it on
        every process (``Checkpoints.save`` does)."""
        if self.stream is not None:
            return {
                **self.position._asdict(),
                "samples": self.samples,
                "batch": self.sizes._asdict(),
                **self.order,
                "stream_state": gathered(self.stream.saved(self._stream_state)),
            }
        return {
            **self.position._asdict(),
            "samples": self.samples,
            "batch": self.sizes._asdict(),
            **self.order,
            "fingerprint": self.source.fingerprint,
        }

    def check_data(self, state: dict[str, Any]) -> None:
        """Raises ``ValueError`` unless ``state`` (from :meth:`state`) was saved for this
        loader's data and order, naming what differs (:meth:`restore` checks it first)."""
        read = "random-access source" if self.stream is None else f"stream ({self.stream.kind})"
        if ("stream" in state or "dataset_size" in state) and ("stream" in state) != (
            self.stream is not None
        ):
            was = f"stream ({state['stream']})" if "stream" in state else "random-access source"
            raise ValueError(
                f"the restored position was saved by a loader of a {was}; this loader reads a "
                f"{read}: a position indexes one kind of data"
            )
        for key in _ORDER if self.stream is None else ("stream", "processes"):
            if key in state and state[key] != self.order[key]:
                raise ValueError(
                    f"the restored position was saved with {key}={state[key]!r}; this loader "
                    f"has {key}={self.order[key]!r}: a position indexes one data set's order"
                    + (
                        " (a stream's position is each process's place in its own shard)"
                        if key == "processes"
                        else ""
                    )
                )
        if "fingerprint" in state:
            changed = difference(state["fingerprint"], self.source.fingerprint)
            if changed is not None:
                raise ValueError(
                    f"the restored position was saved for other data: {changed}. A position "
                    "indexes one data set's order; resume on the data it was saved with, or "
                    "start a new run"
                )

    def restore(self, state: dict[str, Any], *, force: bool = False) -> SamplerPosition:
        """Continues where ``state`` (from :meth:`state`) stood; returns the new position.

        The same global batch continues at the same rows on any split of it over
        devices and micro-batches (at an optimizer-step boundary; mid-window
        only with the same split). Refused with ``ValueError`` naming both
        values: another data set length, shuffle, seed, ``drop_last`` or
        ``last_window`` (a position indexes one order); another
        ``global_batch_size`` unless ``force`` (then the epoch continues at the
        step holding its first unseen row, :func:`jaxdp.resume_position`).
        Another source than the one saved is refused naming what changed (rows,
        a field's shape or dtype, or the contents: :mod:`jaxdp.data._fingerprint`),
        the same data under another path accepted. Keys absent from ``state``
        (a checkpoint saved with a bare position, or before fingerprints) are
        not checked.
        """
        self.check_data(state)
        saved = BatchSizes(**state["batch"])
        position = SamplerPosition(state["epoch"], state["step_in_epoch"], state["micro_batch"])
        if self.stream is not None and saved.global_batch_size != self.sizes.global_batch_size:
            raise ValueError(
                f"the restored position of a stream was saved with {saved.describe()}; this "
                f"loader has {self.sizes.describe()}: a stream's position counts its calls of "
                "one global batch (force does not apply)"
            )
        if saved.global_batch_size != self.sizes.global_batch_size and not force:
            raise ValueError(
                f"the restored position was saved with {saved.describe()}; this loader has "
                f"{self.sizes.describe()}: another global batch changes the data order "
                "(pass force=True to continue at the step holding the first unseen row)"
            )
        if position.micro_batch and (saved != self.sizes or self.path == "fused"):
            raise ValueError(
                f"the restored position is micro-batch {position.micro_batch} of an open "
                f"window of {saved.describe()}; this loader ({self.path}, "
                f"{self.sizes.describe()}) can only continue it with the same split on the "
                "multisteps path"
            )
        self.samples = int(state.get("samples", 0))
        if self.stream is not None:
            self.position = position
            self._stream_state = state["stream_state"][self.share.process_index]
            calls = position.step_in_epoch * self.calls_per_step + position.micro_batch
            if self.stream.kind == "none" and calls:
                warnings.warn(
                    f"the {self.stream.name} has no saved state (no get_state()/set_state() on "
                    "its iterators, no state_dict()/load_state_dict()): the resume reads epoch "
                    f"{position.epoch}'s pass again from its start and discards the "
                    f"{calls * self.share.sizes.global_batch_size // self.calls_per_step} "
                    "records of this process already trained on (the same rows only if each "
                    "pass yields the same records)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return self.position
        self.position = resume_position(
            position, saved=saved, sizes=self.sizes, steps_per_epoch=self.steps_per_epoch
        )
        return self.position

"""A streamed source: records in its own order, this process's shard, its position its own state.

How large corpora are read at scale: a grain ``IterDataset`` or a Hugging Face streaming
``IterableDataset``, each process given its own shard (grain: the ``MapDataset`` sliced
with ``grain.sharding.ShardByJaxProcess()``'s ``shard_index::shard_count`` before
``to_iter_dataset()``, or its files; Hugging Face:
``datasets.distributed.split_dataset_by_node(ds, rank=jax.process_index(),
world_size=jax.process_count())``). The loader takes the next records of the shard for
each call, in the stream's order, and saves where it stands as the stream's own state:

- ``"iterator"``: an object whose iterators have ``get_state()`` and ``set_state(state)``
  (a grain ``IterDataset``: grain's checkpoint protocol). A pass is a fresh ``iter()``.
- ``"state_dict"``: an object with ``state_dict()`` and ``load_state_dict(state)`` (a
  Hugging Face ``IterableDataset``, torchdata's ``Stateful``), used as its library
  teaches: ``set_epoch(epoch)`` before each pass where it has one (Hugging Face
  reshuffles its shards and buffer by epoch, and applies a loaded state to its epoch
  alone), ``load_state_dict(state)`` at a resume, then ``iter()``. The loader sets the
  object given (a copy shares its iteration state: Hugging Face's epoch is a shared
  tensor, and ``copy.deepcopy`` of one failed while reading); iterate it nowhere else
  while the loader does. A Hugging Face ``IterableDataset`` is read in its numpy format
  (``with_format("numpy")``, a view sharing its state), whatever its own, as a
  ``datasets.Dataset`` is.
- ``"none"``: any other iterable that starts over when iterated again (a torch
  ``IterableDataset``, a class with ``__iter__``). It has no state to save: a restore
  starts its pass again and reads and discards the calls already trained on (bitwise
  when each pass yields the same records), with a warning naming how many.

Nothing is imported here: the kinds are known by what their objects offer.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from ._kinds import is_kind
from ._source import Transform, checked, stack, transformed

StreamKind = Literal["iterator", "state_dict", "none"]


def is_stream(source: Any) -> bool:
    """Whether ``source`` is read as a stream: iterable, without random access."""
    random_access = hasattr(source, "__len__") and hasattr(source, "__getitem__")
    return hasattr(source, "__iter__") and not random_access


class Stream:
    """A checked streamed source: passes over this process's shard, resumable at a state.

    Raises ``TypeError`` at construction for an iterator (a generator: it cannot start a
    second pass, nor be restarted at a resume) and a torch ``DataLoader`` (it batches
    itself), naming what to pass instead.
    """

    def __init__(self, source: Any, transform: Transform | None = None):
        if transform is not None and not callable(transform):
            raise TypeError(f"transform={transform!r} must be callable (record -> record) or None")
        if is_kind(source, "torch", "DataLoader"):
            raise TypeError(
                f"source is a torch DataLoader ({type(source).__name__}): it batches rows "
                "itself; pass its dataset (loader.dataset): the loader batches it"
            )
        if isinstance(source, Iterator):
            raise TypeError(
                f"source is an iterator ({type(source).__name__}): it is read once and cannot "
                "start again at the next epoch or at a resume; pass an iterable that starts "
                "over when iterated (a class with __iter__, a grain IterDataset, a Hugging "
                "Face IterableDataset)"
            )
        if is_kind(source, "datasets", "IterableDataset"):
            # Any format reads as its numpy format, as a datasets.Dataset does (_kinds): the
            # default python format gives an array column as a list, stacked as its values.
            source = source.with_format("numpy")
        self.source, self.transform = source, transform
        self.kind: StreamKind = (
            "iterator"
            if is_kind(source, "grain", "IterDataset")
            else "state_dict"
            if callable(getattr(source, "state_dict", None))
            and callable(getattr(source, "load_state_dict", None))
            else "none"
        )
        self.name = type(source).__name__
        self._reading: tuple[int, float] | None = None  # (record of the pass, since when)

    def passes(self, epoch: int, state: Any, skip: int) -> Pass:
        """A pass over the shard for ``epoch``, at ``state`` (None: its start), after
        reading and discarding ``skip`` records (a stateless stream's resume)."""
        if self.kind == "iterator":
            records = iter(self.source)
            if state is not None:
                records.set_state(state)
            return Pass(self, records, lambda: records.get_state(), skip)
        if self.kind == "state_dict":
            dataset = self.source
            if callable(getattr(dataset, "set_epoch", None)):
                dataset.set_epoch(epoch)
            if state is not None:
                dataset.load_state_dict(state)
            return Pass(self, iter(dataset), dataset.state_dict, skip)
        return Pass(self, iter(self.source), lambda: None, skip)

    def stuck(self) -> str:
        """The read that has run longest, in words (for a read timeout's error)."""
        reading = self._reading
        if reading is None:
            return "no read is running (the placement on the devices is slow or stuck)"
        index, since = reading
        return (
            f"the read of record {index} of this process's pass over the {self.name} has "
            f"not returned in {time.monotonic() - since:.1f} s"
        )

    def saved(self, state: Any) -> Any:
        """``state`` as JSON will read it back (a checkpoint's meta is JSON); refused naming
        the stream if JSON cannot hold it."""
        try:
            return json.loads(json.dumps(state, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"the {self.name}'s state ({self.kind}) must be JSON to go with a checkpoint: {e}"
            ) from None


class Pass:
    """One pass over the shard: ``take(n)`` the next ``n`` records as a batch, ``state()``
    where it stands after them."""

    def __init__(self, stream: Stream, records: Iterator[Any], state: Any, skip: int):
        self.stream, self.records, self.state = stream, records, state
        self.read = 0  # records of the pass read so far
        for _ in itertools.islice(self.records, skip):  # a stateless stream's resume
            self.read += 1

    def take(self, n: int) -> Any | None:
        """The next ``n`` records stacked field by field (through the transform), or None
        where the pass has fewer left (its tail, dropped)."""
        records = []
        for record in itertools.islice(self.records, n):
            index = self.read
            self.stream._reading = (index, time.monotonic())
            records.append(transformed(self.stream.transform, record, index))
            self.read += 1
        self.stream._reading = None
        if len(records) < n:
            return None
        rows = np.arange(self.read - n, self.read)
        return checked(stack(records, rows), rows, "field")


def everyone(have: bool) -> bool:
    """Whether every process has ``have`` (one small all-gather; True alone on one process)."""
    import jax

    if jax.process_count() == 1:
        return have
    from jax.experimental import multihost_utils

    return bool(np.min(multihost_utils.process_allgather(np.array([have], np.int32))))


def gathered(state: Any) -> list[Any]:
    """Every process's ``state`` (JSON), in process order, on every process (two small
    all-gathers under several processes)."""
    import jax

    if jax.process_count() == 1:
        return [state]
    from jax.experimental import multihost_utils

    mine = np.frombuffer(json.dumps(state).encode(), np.uint8)
    lengths = multihost_utils.process_allgather(np.array([len(mine)], np.int64)).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(mine)] = mine
    every = multihost_utils.process_allgather(padded).reshape(len(lengths), -1)
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(every, lengths, strict=True)]

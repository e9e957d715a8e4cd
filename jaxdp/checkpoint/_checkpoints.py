"""Checkpoints of a training run with orbax: atomic, verified, resumable exactly.

A checkpoint directory holds one sub-directory per checkpoint, named by the
optimizer step of its state (``int(state.step)``: updates applied); the samples
consumed are in its metadata. Numbers only increase and a number is never
written twice, so a stop inside an accumulation window, whose state has the
step of the window's start, cannot be saved where that step is already
checkpointed. orbax writes each into a temporary directory and renames it when
complete, so a crash mid-save leaves no half checkpoint under a step number.
Each holds up to four orbax items: ``replicated`` (step, params, optimizer
state, model state), ``per_device`` (the ``multisteps`` path's window sums, one
row per device), ``shards`` (leaves split over the mesh at ZeRO stages, each
process writing its blocks) and ``meta`` (JSON: sampler position, batch
identity, seed, the shape, dtype and placement of every leaf and a SHA-256 of
its bytes, and a SHA-256 of the meta itself: :mod:`._meta`). A leaf is read
into the layout of the run that restores it (another device count, another
ZeRO stage, HSDP's shard groups or none), and an open window's gradient sums
into this run's layout of them (:mod:`._window`); checkpoints of jaxdp 0.2
(format 2) are converted as they are read (:mod:`._format2`).
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - its exit hook registered before ours
import contextlib
import functools
import os
import pathlib
import shutil
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

from .._checks import is_integer
from .._layout import BatchSizes
from .._position import SamplerPosition
from .._train_state import TrainState, check_live
from . import _background, _format2
from ._agree import process_0s
from ._data import OWN, DataPosition, check_data, from_data, restore_data, sizes_of
from ._interrupted import raise_if_interrupted
from ._meta import FORMAT, array_sha256, check_sealed, check_sha256, sealed
from ._quiet import quiet_failed_read_noise
from ._rules import (
    CheckpointError,
    check_compatible,
    check_is_directory,
    check_position,
    describe,
    is_accumulator,
    leaf_name,
    named,
)
from ._saving import saving
from ._tree import abstract, join, kind, own_shapes, saved_tree, split, state_from_tree, zeros
from ._window import param_shape, read_as, relaid, relay
from ._write_failure import no_room, quiet_writer_thread_logs


class Restored(NamedTuple):
    """A checkpoint read back by :meth:`Checkpoints.restore`."""

    state: TrainState  # placed on the current mesh with ``like``'s shardings
    position: SamplerPosition | None  # as saved (None: without one); :func:`resume_position`
    sizes: BatchSizes | None  # the batch identity it was saved with (None: without one)
    samples: int | None  # training samples consumed when it was saved (None: not given)
    seed: int
    extra: dict[str, Any]
    path: pathlib.Path
    data: dict[str, Any] | None = None  # the dict given as ``save(data={...})``, as JSON reads it


class Metadata(NamedTuple):
    """A checkpoint's account of itself, read without its arrays (:meth:`Checkpoints.metadata`)."""

    step: int  # optimizer updates applied; the checkpoint's number
    position: SamplerPosition | None  # the next data to train on, as saved (None: without one)
    sizes: BatchSizes | None  # the batch identity it was saved with (None: without one)
    samples: int | None  # training samples consumed (None: not given)
    seed: int
    extra: dict[str, Any]  # what ``save`` was given (``jaxdp train``: its config)
    path: pathlib.Path
    data: dict[str, Any] | None = None  # the dict given as ``save(data={...})``


class CorruptCheckpointWarning(UserWarning):
    """The newest checkpoint was unreadable; an older one was used instead."""


class Checkpoints:
    """A directory of training checkpoints (orbax ``CheckpointManager``).

    ``save`` writes atomically (a temporary directory renamed when complete),
    then (``verify=True``) reads the checkpoint back and compares every leaf
    with the SHA-256 taken before writing. ``keep`` bounds how many are kept
    (None: all), but a checkpoint is deleted only behind a newer one verified
    in this process (written and read back, or restored), so an unreadable
    newer checkpoint never costs an older one. ``verify=False`` trusts the
    write (``restore`` still checks every SHA-256).

    ``background=True``: ``save`` returns once the state is copied off the
    devices into host memory; a thread of its own takes the SHA-256s, writes,
    reads back and prunes, while training goes on. Every guarantee holds: the
    checkpoint appears under its number only once complete (a process killed at
    any moment leaves the newest complete one, which ``restore`` reads), and it
    counts for ``keep`` only once verified. One save is in flight at a time: the
    next ``save``, ``restore``, ``metadata``, ``steps`` and
    :meth:`wait_until_finished` wait for it first and raise its error, if any,
    as :class:`CheckpointError` (a failure is also printed on stderr when it
    happens, for a script that never asks again). A script that ends with a save
    in flight (normally, by ``sys.exit``, by an exception) exits once that
    checkpoint is written and verified. Under ``jax.distributed`` every process
    calls ``save`` at the same step; each copies what it holds (its blocks of a leaf
    split over processes), and the thread joins the processes only by the JAX
    distributed client's barriers and key-value store, never a device collective nor
    JAX's preemption sync point (:mod:`._background`): process 0 writes the whole
    arrays and renames, each process reads its part back, process 0 prunes, and no
    process's save ends before that.
    """

    def __init__(
        self,
        directory: str | pathlib.Path,
        *,
        keep: int | None = 3,
        verify: bool = True,
        background: bool = False,
    ):
        if keep is not None and (not is_integer(keep) or keep < 1):
            raise ValueError(f"keep={keep!r} must be a positive integer, or None to keep all")
        if not isinstance(verify, bool):
            raise TypeError(f"verify={verify!r} must be True or False")
        if not isinstance(background, bool):
            raise TypeError(f"background={background!r} must be True or False")
        self.directory = pathlib.Path(directory).absolute()
        check_is_directory(directory, name="directory")
        self.keep = None if keep is None else int(keep)
        self.verify = verify
        self.background = background
        self._writing: _Writing | None = None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,
            enable_async_checkpointing=False,
            create=True,
            # Not on opening: a temporary directory may be another process's save in
            # progress. A save removes the leftovers when none runs (:mod:`._saving`).
            cleanup_tmp_directories=False,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._verified: set[int] = set()
        self._saves = 0  # background saves started
        # Installed before a failure: its noise comes while the write or read fails.
        quiet_writer_thread_logs()
        quiet_failed_read_noise()

    @property
    def steps(self) -> list[int]:
        """Numbers (optimizer steps) of the complete checkpoints, ascending (after a
        background save in flight)."""
        self.wait_until_finished()
        return self._steps()

    def _steps(self) -> list[int]:
        """:attr:`steps` as the directory lists them now (the writer's own view)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Waits for the background save in flight, if any; raises its error
        (:class:`CheckpointError`) once. Without ``background=True`` there is none."""
        writing = self._writing
        if writing is None or writing is threading.current_thread():
            return
        writing.join()  # a Ctrl-C here leaves it in flight, waited for next time
        self._writing = None
        if writing.error is not None:
            raise writing.error

    def save(
        self,
        state: TrainState,
        *,
        position: SamplerPosition | None = None,
        sizes: BatchSizes | None = None,
        samples: int | None = None,
        seed: int | None = None,
        extra: dict[str, Any] | None = None,
        data: DataPosition | Mapping[str, Any] | None = None,
    ) -> pathlib.Path:
        """Writes ``state`` as checkpoint number ``int(state.step)``; returns its path.

        ``position`` is the next data to train on, ``sizes`` the batch identity,
        ``samples`` the training samples consumed and ``extra`` any
        JSON-serializable record (``jaxdp train`` stores its config). With
        ``data=`` a :class:`jaxdp.data.Loader`, its :meth:`~jaxdp.data.Loader.state`
        gives all four (the loader's position is what the loop was given last)
        and is saved whole, so :meth:`restore` can set the loader back; giving
        ``position`` or ``sizes`` too is refused.

        With a data pipeline of your own, ``save(state)`` alone writes the state,
        and ``data=`` a dict (your pipeline's position, e.g. ``{"epoch": 3,
        "offset": 120}``: JSON, string keys; tuples come back as lists) is kept
        and handed back as :attr:`Restored.data`. ``position``, ``sizes`` and
        ``samples`` go together (all or none); without them the checkpoint has
        no batch identity to check, and a state mid-way through a ``multisteps``
        window is refused (its sums belong to one split: save after the call that
        ends the window, or give the three). Raises
        :class:`CheckpointError` if the step is not newer than every checkpoint
        there (one of that number exists already: checkpoints are never
        overwritten), if it cannot be written (a full disk is named as such,
        with the newest checkpoint, which is kept), or if it does not read back
        intact, and ``ValueError`` before anything is written if ``state``'s
        buffers were donated to a step's call (save the state that call returned).
        """
        self.wait_until_finished()
        check_live(state)
        position, sizes, samples, seed, loader, own = from_data(
            state, data, position, sizes, samples, seed
        )
        number, steps = int(state.step), self._steps()
        if number in steps:
            raise CheckpointError(
                f"checkpoint {self.directory / str(number)} exists already: step={number} is "
                "taken (checkpoints are numbered by optimizer step and never overwritten)"
            )
        if steps and number < steps[-1]:
            raise CheckpointError(
                f"step={number} must exceed the newest checkpoint's step {steps[-1]} in "
                f"{self.directory}; restore reads the newest"
            )
        if position is not None:
            check_position(state, position)
        tree, shapes = saved_tree(state), own_shapes(state)
        meta = {
            "format": FORMAT,
            "samples": samples,
            "step": number,
            "position": position._asdict() if position is not None else None,
            "batch": sizes._asdict() if sizes is not None else None,
            "seed": seed,
            # SHA-256s: _write. Stage 3's padded leaves in the model's shapes (own_shapes).
            "leaves": {name: describe(x, shapes.get(name)) for name, x in named(tree)},
            "extra": extra or {},
        }
        if loader is not None:
            meta["data"] = loader
        if own is not None:
            meta[OWN] = own
        items = {  # every process writes its own blocks
            item: part
            for item, part in split(tree).items()
            if item == "replicated" or jax.tree.leaves(part)
        }
        if not self.background:
            self._write(number, meta, items, like=state)
        else:
            items = _background.on_host(items)  # all a background save blocks for
            self._saves += 1  # names its barriers: every process counts the same saves
            self._writing = _Writing(
                self.directory / str(number),
                functools.partial(self._write, number, meta, items, like=None),
            )
        return self.directory / str(number)

    def _write(
        self,
        number: int,
        meta: dict[str, Any],
        items: dict[str, Any],
        like: TrainState | None,
    ) -> None:
        """Seals ``meta`` with every leaf's SHA-256, writes the checkpoint, reads it back
        (``verify``: into ``like``'s layout) and prunes. Without ``like`` it is a background
        save's, in its own thread beside the step (:mod:`._background`): ``items`` are in
        host memory, and only orbax's barriers of the distributed client join processes."""
        # Process 0 writes the meta: in a background save, beside the step, no other process
        # takes SHA-256s that would not be written (on a split leaf orbax's checks apply).
        hashes = like is not None or jax.process_index() == 0
        shapes = {name: d["shape"] for name, d in meta["leaves"].items()}
        digests = {
            name: array_sha256(x, shapes[name])
            if hashes and not isinstance(x, _background.Shards)
            else None
            for part in items.values()
            for name, x in named(part)
        }
        leaves = {name: {**d, "sha256": digests[name]} for name, d in meta["leaves"].items()}
        meta = sealed({**meta, "leaves": leaves})
        args = {"meta": ocp.args.JsonSave(meta)}
        args.update({item: ocp.args.StandardSave(part) for item, part in items.items()})
        path = self.directory / str(number)
        # Process 0 creates the temporary directory and renames it; it holds the lock.
        lock = saving(self.directory) if jax.process_index() == 0 else contextlib.nullcontext()
        try:
            with lock:
                if like is not None:
                    self._manager.save(number, args=ocp.args.Composite(**args), force=True)
                else:
                    args.update(
                        {
                            item: ocp.args.StandardSave(_background.to_write(part))
                            for item, part in items.items()
                        }
                    )
                    self._background_writer(number).save(path, ocp.args.Composite(**args))
        except Exception as e:
            raise_if_interrupted(
                e,
                f"writing checkpoint {path} was interrupted; an unfinished write is removed "
                "by a later save there",
            )
            raise self._write_failed(number, e) from e
        if like is not None:
            if self.verify:
                try:
                    self._read(number, meta, like, accumulators=True)
                except Exception as e:
                    raise self._read_back_failed(number, e) from e
            self._verified.add(number)
            self._prune(self._manager.delete)
            return
        name, error = self._barriers(number), None
        if self.verify:
            try:
                self._read_on_host(number, meta, items)
            except Exception as e:
                error = e
        others = _background.all_read_back(self.directory, name, error and _short(error))
        failed = None
        if error is not None:
            failed = self._read_back_failed(number, error)
        elif others:
            failed = CheckpointError(
                f"checkpoint {path} does not read back intact on every process "
                f"({'; '.join(others)}); older checkpoints are kept"
            )
        elif jax.process_index() == 0:  # alone: the others are training, not at a barrier
            self._verified.add(number)
            try:
                self._prune(lambda n: shutil.rmtree(self.directory / str(n)), agreed=False)
            except Exception as e:
                failed, error = CheckpointError(f"pruning behind {path} failed: {_short(e)}"), e
        said = _background.ended(self.directory, name, failed and str(failed))
        if failed is not None:
            raise failed from error
        if said is not None:
            raise CheckpointError(f"process 0 of the save of {path} failed: {said}")
        self._verified.add(number)

    def _read_back_failed(self, number: int, error: Exception) -> CheckpointError:
        raise_if_interrupted(
            error,
            f"checkpoint {self.directory / str(number)} was written; reading it back to "
            "verify was interrupted",
        )
        return CheckpointError(
            f"checkpoint {self.directory / str(number)} does not read back intact "
            f"({_short(error)}); older checkpoints are kept"
        )

    def _barriers(self, number: int) -> str:
        """The name of a background save's barriers: its number and its count."""
        return f"{number}_{self._saves}"

    def _background_writer(self, number: int) -> ocp.Checkpointer:
        return _background.writer(self.directory, self._barriers(number))

    def preempted(self, state: TrainState, **save: Any) -> bool:
        """Whether the run was asked to stop, with ``state`` saved if so: True on every
        process at the same optimizer step. Call it after every call of the step, on
        every process; ``save`` is :meth:`save`'s keywords (``data=loader``...).

        The notice is JAX's own: under ``jax.distributed`` (several processes, as
        :func:`jaxdp.initialize` starts them) JAX's preemption notifier takes SIGTERM
        (as Slurm, ``mpirun`` and ``jaxdp launch`` send it before ending a job) and its
        preemption sync point (``multihost_utils.reached_preemption_sync_point``) picks
        the next optimizer step every process reaches: there this saves ``state``
        (unless that step is saved already), waits until it is written, and returns
        True, so the loop stops (``break``) on every process at the same step. A
        multisteps window is never cut: the step counts optimizer updates, so the stop
        comes at a window's end. It reads ``state.step`` (one host read per call). With
        one process and no distributed runtime there is no notice (SIGTERM ends the
        process, as Python's default does) and it returns False; a Python SIGTERM
        handler of your own replaces JAX's and with it the notice.
        """
        from jax.experimental import multihost_utils

        number = int(state.step)
        if not multihost_utils.reached_preemption_sync_point(number):
            return False
        if number not in self.steps:
            self.save(state, **save)
        self.wait_until_finished()
        return True

    def restore(
        self,
        like: TrainState,
        *,
        sizes: BatchSizes | None = None,
        force: bool = False,
        validate: Callable[[dict[str, Any]], None] | None = None,
        data: DataPosition | None = None,
    ) -> Restored:
        """Reads the newest usable checkpoint into a state shaped like ``like``.

        ``like`` is what :meth:`TrainStep.init` returns for this run (arrays or
        ``jax.ShapeDtypeStruct`` with shardings): the restored state takes its
        structure, shardings and NNX graph. ``sizes`` is this run's batch
        identity, which may be left out only for a checkpoint saved without one
        (``save(state)``, a pipeline of your own: the batch rules below then do
        not apply). Rules, checked before any array is read:

        - parameters must have the saved names, shapes and dtypes (else
          :class:`CheckpointError` naming each mismatch);
        - ``validate(extra)`` may refuse (e.g. another optimizer);
        - the rest of the state must have the saved names, shapes and dtypes
          (where a leaf lies may differ: another device count or ZeRO stage);
        - another ``global_batch_size`` is refused unless ``force``: the data
          order and the meaning of a step would change;
        - another ``num_devices``/``accum_steps``/``micro_batch_size`` needs a
          checkpoint at an optimizer-step boundary, where the window's sums are
          zero and rebuilt for this run: mid-window they cannot be re-split.
          Mid-window another ZeRO stage or ``shards`` is read: each gradient
          sum's total is laid out as this run keeps it (equal to rounding).

        An unreadable checkpoint (bad files, failed checksum) is skipped with a
        :class:`CorruptCheckpointWarning`, the next older one is tried, and once
        one restores the skipped ones are renamed ``<n>.corrupt`` (kept, never
        deleted) so new checkpoints can take their numbers.

        With ``data=`` a :class:`jaxdp.data.Loader`, ``sizes`` defaults to the
        loader's and the loader is set to continue where the checkpoint's data
        stood (:meth:`jaxdp.data.Loader.restore`: another data set length or
        order refused with both values), before any array is read. A dict given
        as ``save(data={...})`` comes back as :attr:`Restored.data`.
        """
        self.wait_until_finished()
        sizes = sizes_of(data, sizes)
        failures: list[tuple[int, Exception]] = []
        for number, meta in self._newest_first(failures):
            path = self.directory / str(number)
            shapes = own_shapes(like)
            here = {name: describe(x, shapes.get(name)) for name, x in named(saved_tree(like))}
            if data is not None:  # first: other data explain most other differences
                check_data(data, meta, path=path)
            if meta["format"] == 2:
                meta = _format2.upgraded_meta(meta, here)
            saved = check_compatible(meta, here, sizes, force=force, path=path, validate=validate)
            if data is not None:
                restore_data(data, meta, force=force, path=path)
            try:  # the window's sums: read mid-window (they fit), zero at a boundary
                state = self._read(number, meta, like, accumulators=_mid_window(meta))
            except Exception as e:
                raise_if_interrupted(e, f"reading checkpoint {path} was interrupted (kept)")
                failures.append((number, e))
                quiet_failed_read_noise()
                continue
            self._set_aside(failures, path)
            self._verified.add(number)
            return Restored(
                state=state,
                position=_position(meta),
                sizes=saved,
                samples=meta["samples"],
                seed=meta["seed"],
                extra=meta["extra"],
                path=path,
                data=meta.get(OWN),
            )
        raise self._nothing_readable(failures)

    def metadata(self) -> Metadata:
        """The newest checkpoint's own account (step, position, batch, ``extra``), no arrays.

        Reads the metadata of the newest checkpoint whose metadata reads: a
        look before restoring (``jaxdp train --resume`` takes its config from
        ``extra``). Its arrays are not checked, so :meth:`restore` may still
        fall back to an older checkpoint. Raises :class:`CheckpointError` if no
        checkpoint's metadata reads.
        """
        failures: list[tuple[int, Exception]] = []
        for number, meta in self._newest_first(failures):
            return Metadata(
                step=meta["step"],
                position=_position(meta),
                sizes=BatchSizes(**meta["batch"]) if meta["batch"] is not None else None,
                samples=meta["samples"],
                seed=meta["seed"],
                extra=meta["extra"],
                path=self.directory / str(number),
                data=meta.get(OWN),
            )
        raise self._nothing_readable(failures)

    # ---- helpers ----------------------------------------------------------------

    def _newest_first(self, failures: list[tuple[int, Exception]]) -> Iterator[tuple[int, Any]]:
        """``(number, meta)`` of every checkpoint whose meta reads, newest first.

        Those that do not read are added to ``failures``.
        """
        for number in reversed(self.steps):
            try:
                meta = self._read_meta(number)
            except Exception as e:
                path = self.directory / str(number)
                raise_if_interrupted(e, f"reading checkpoint {path} was interrupted (kept)")
                failures.append((number, e))
                quiet_failed_read_noise()
                continue
            yield number, meta

    def _nothing_readable(self, failures: list[tuple[int, Exception]]) -> CheckpointError:
        if not failures:
            return CheckpointError(f"no checkpoint in {self.directory}")
        return CheckpointError(
            f"no readable checkpoint in {self.directory}: "
            + "; ".join(f"{n}: {_short(e)}" for n, e in failures)
        )

    def _write_failed(self, number: int, error: Exception) -> CheckpointError:
        """One line for a failed write: the path, the cause, the newest checkpoint (kept)."""
        path = self.directory / str(number)
        cause = no_room(error)
        cause = f"no room left: {cause}" if cause else _short(error)
        newest = [n for n in self._steps() if n < number]
        verified = [n for n in newest if n in self._verified]
        if verified:
            kept = f"the newest valid checkpoint is {self.directory / str(verified[-1])}, kept"
        elif newest:
            kept = f"the newest checkpoint is {self.directory / str(newest[-1])}, kept"
        else:
            kept = "no checkpoint was written before it"
        return CheckpointError(
            f"checkpoint {path} could not be written ({cause}); {kept}; the partial write is "
            "removed by a later save there"
        )

    def _read_meta(self, number: int) -> dict[str, Any]:
        meta = self._manager.restore(number, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return check_sealed(meta["meta"])

    def _read(
        self, number: int, meta: dict[str, Any], like: TrainState, *, accumulators: bool
    ) -> TrainState:
        """Reads arrays into ``like``'s shardings and checks them against the SHA-256s;
        the window's sums only with ``accumulators`` (else zeros). A leaf is read from
        the item it was saved in and laid out as this run keeps it (another device
        count, another ZeRO stage)."""
        if meta["format"] == 2:
            tree = _format2.read(self._manager, number, meta, saved_tree(like), self.directory)
            if not accumulators:
                tree = jax.tree_util.tree_map_with_path(
                    lambda p, x: zeros(x) if is_accumulator(leaf_name(p)) else x, tree
                )
            return state_from_tree(tree, like)
        leaves, shapes = meta["leaves"], own_shapes(like)
        # Stage 3's padded leaves: saved padded for one shard count and read for another,
        # orbax pads with zeros or drops the padding at each dimension's end (not strict),
        # the model's shapes having been compared first (check_compatible).
        padded = bool(shapes) or any("stored" in d for d in leaves.values())

        def saved_kind(name: str, _: Any) -> str:
            return kind(name, leaves[name]["per_device"])

        def target(path: Any, x: Any) -> jax.ShapeDtypeStruct:
            # A window's gradient sum saved in another layout is read as saved, then
            # re-laid out (:mod:`._window`); every other leaf straight into this run's.
            name = leaf_name(path)
            if accumulators and relaid(name, leaves, shapes.get(name, x.shape)):
                return read_as(leaves[name]["shape"], x, whole=padded)
            return abstract(x)

        like_tree = saved_tree(like)
        parts = split(like_tree, saved_kind)
        if not accumulators:  # not read: at an optimizer-step boundary they are zero
            parts["per_device"] = jax.tree.map(zeros, parts["per_device"])
        wanted = {
            item: part
            for item, part in parts.items()
            if jax.tree.leaves(part) and (item != "per_device" or accumulators)
        }
        out = self._manager.restore(
            number,
            args=ocp.args.Composite(
                **{
                    item: ocp.args.StandardRestore(
                        jax.tree_util.tree_map_with_path(target, part), strict=not padded
                    )
                    for item, part in wanted.items()
                }
            ),
        )
        tree = join(*(out[item] if item in wanted else part for item, part in parts.items()))
        check_sha256(tree, leaves, lambda name: accumulators or not is_accumulator(name))

        def laid_out(path: Any, x: Any, here: Any) -> Any:
            name = leaf_name(path)
            if x.shape == here.shape or not relaid(name, leaves, shapes.get(name, here.shape)):
                return x
            return relay(x, here, rank=len(param_shape(name, leaves)))

        tree = jax.tree_util.tree_map_with_path(laid_out, tree, like_tree)
        return state_from_tree(tree, like)

    def _read_on_host(self, number: int, meta: dict[str, Any], items: dict[str, Any]) -> None:
        """Reads back what this process of a background save wrote, laid out as ``items``
        (host arrays, and this process's blocks of split leaves), and checks it against
        the SHA-256s of the meta read back (process 0's: it alone takes them, and checks
        that meta is the one it sealed): no device program, which would run beside the
        step's. Process 0 alone wrote the whole arrays, so only it reads them back."""
        written = {
            item: _background.to_read(part)
            for item, part in items.items()
            if jax.process_index() == 0 or item != "replicated"
        }
        args = {item: ocp.args.StandardRestore(part) for item, part in written.items()}
        out = self._background_writer(number).restore(
            self.directory / str(number),
            ocp.args.Composite(meta=ocp.args.JsonRestore(), **args),
        )
        read = check_sealed(out["meta"])  # process 0's, sealed with its SHA-256s
        if jax.process_index() == 0 and read != check_sealed(meta):
            raise CheckpointError("its meta is not the one written")
        check_sha256({item: out[item] for item in written}, read["leaves"], lambda name: True)

    def _set_aside(self, failures: list[tuple[int, Exception]], used: pathlib.Path) -> None:
        for number, error in failures:
            bad = self.directory / str(number)
            target = bad.with_name(f"{number}.corrupt")
            for i in range(1, 1000):
                if not target.exists():
                    break
                target = bad.with_name(f"{number}.corrupt-{i}")
            if jax.process_index() == 0:
                bad.rename(target)
            warnings.warn(
                f"checkpoint {bad} is unreadable ({_short(error)}); "
                f"moved it to {target} (kept, not deleted) and resumed from {used}",
                CorruptCheckpointWarning,
                stacklevel=3,
            )
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes("jaxdp_checkpoints_set_aside")
        self._manager.reload()

    def _prune(self, delete: Callable[[int], None], *, agreed: bool = True) -> None:
        """Deletes all but the ``keep`` newest, each only behind a verified newer one, by
        ``delete`` on every process (the numbers ``agreed``: process 0's), or on one."""
        if self.keep is None or not self._verified:
            return
        newest_verified = max(self._verified)
        steps = process_0s(self._steps()) if agreed else self._steps()
        for number in steps[: -self.keep]:  # the same deletes everywhere
            if number < newest_verified:
                delete(number)
                self._verified.discard(number)


class _Writing(threading.Thread):
    """A background save: a thread running ``write()``, its error kept for the next call of
    :class:`Checkpoints` (and printed when it happens).

    Not a daemon, and joined when the script ends before Python's shutdown refuses new
    ``concurrent.futures`` work (:func:`_finish_saves_at_exit`): orbax runs every file
    operation of a save through ``asyncio.to_thread``."""

    def __init__(self, path: pathlib.Path, write: Callable[[], None]):
        super().__init__(name=f"jaxdp-checkpoint-{path.name}", daemon=False)
        self.path, self.write = path, write
        self.error: BaseException | None = None
        self.abandoned = False  # a Ctrl-C at exit gave it up: its failure says nothing new
        _finish_saves_at_exit()
        self.start()

    def run(self) -> None:
        _beneath_the_step()
        try:
            self.write()
        except BaseException as e:  # noqa: BLE001 - kept and raised in the caller's thread
            self.error = e
            if not self.abandoned:
                hint = _AT_SHUTDOWN if "interpreter shutdown" in str(e) else ""
                print(
                    f"jaxdp.checkpoint: the background save of {self.path} failed: {e}{hint}",
                    file=sys.stderr,
                )


# How far below the step a background save's thread runs: a nice value added to the
# thread's own (Linux: setpriority of a thread id is that thread's alone, and the threads
# it starts inherit it). 300 MB on 2 processes of 2 cores: a step beside the save took
# 1.86x the time of one alone at the process's priority.
_BENEATH = 10


def _beneath_the_step() -> None:
    """Lowers this thread's priority (and that of the threads it starts) under the step's:
    on a machine whose cores the step uses, the save takes the cores the step leaves."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + _BENEATH)


# Python 3.12.0 to 3.12.2 refuse every new thread once the script has ended, also to the
# non-daemon threads Python is about to join (CPython gh-113964, fixed in 3.12.3).
_AT_SHUTDOWN = (
    " (the script ended with this save in flight, and this Python starts no thread after "
    "that: 3.12.0 to 3.12.2, CPython gh-113964; call wait_until_finished() before it ends)"
)


@functools.cache
def _finish_saves_at_exit() -> None:
    """Has the saves in flight joined when the script ends (once per process).

    At its end (a normal end, ``sys.exit``, an uncaught exception) Python first calls
    ``threading``'s exit hooks, among them ``concurrent.futures``' own, which from then
    on refuses new work (``cannot schedule new futures after interpreter shutdown``),
    and only then joins the non-daemon threads: a save still in flight would fail in
    orbax's next file operation. A hook registered after ``concurrent.futures.thread``'s
    runs before it (they run in reverse order), so the save ends as it would have in
    the script. This is the hook ``concurrent.futures`` itself joins its workers from;
    no ``atexit``, ``excepthook`` or signal handler of the process is touched.
    """
    threading._register_atexit(_join_saves)  # the stdlib's own exit hook


def _join_saves() -> None:
    for thread in threading.enumerate():
        if isinstance(thread, _Writing):
            try:
                thread.join()
            except KeyboardInterrupt:  # the user gives the save up: one line, no traceback
                thread.abandoned = True
                print(
                    f"jaxdp.checkpoint: the background save of {thread.path} was abandoned "
                    "at exit (Ctrl-C); the checkpoints before it stand",
                    file=sys.stderr,
                )
                return


def _position(meta: dict[str, Any]) -> SamplerPosition | None:
    return SamplerPosition(**meta["position"]) if meta["position"] is not None else None


def _mid_window(meta: dict[str, Any]) -> bool:
    """Whether the checkpoint was taken inside a window (its sums are then read)."""
    return meta["position"] is not None and bool(meta["position"]["micro_batch"])


def _short(error: Exception) -> str:
    """The error's type and first words (tensorstore appends kilobytes of spec)."""
    text = str(error).split(" [tensorstore_spec")[0]
    return f"{type(error).__name__}: {text[:400]}"

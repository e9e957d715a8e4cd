"""A Ctrl-C during a checkpoint's write or read is an interrupt, never a bad checkpoint."""

from __future__ import annotations


def raise_if_interrupted(error: BaseException, what: str) -> None:
    """Raises ``KeyboardInterrupt(what)`` from ``error`` if a KeyboardInterrupt is among
    its causes.

    orbax reads and writes each array in an asyncio task and reports whatever stopped one
    as ``Exception("Encountered error while reading array index ...")`` raised from it, so
    a KeyboardInterrupt that lands in a read comes out as an ordinary exception: save
    reported an intact checkpoint as one that "does not read back intact" (whose user may
    delete it), and restore would set a good one aside as corrupt.
    """
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            raise KeyboardInterrupt(what) from error
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__

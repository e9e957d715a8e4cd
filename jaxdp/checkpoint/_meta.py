"""A checkpoint's ``meta`` item, sealed: a SHA-256 of every array, and one of the meta itself.

The arrays' SHA-256s tie the files to the state that was meant to be written;
the meta's own SHA-256 covers everything else a resume acts on (the sampler
position, the batch identity, the seed, the samples, the saved configuration
and the arrays' SHA-256s themselves), so a changed byte there is an unreadable
checkpoint, never a resume two batches late.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._rules import CheckpointError, named

# The layout of ``meta`` and of the state saved; bumped when either changes. 2: the
# meta's own SHA-256 (jaxdp 0.2). 3: the window in ``window``, every leaf in its own
# shape (jaxdp 0.3); format 2 is read and converted (:mod:`._format2`).
FORMAT = 3
READ = (2, 3)
_SEAL = "meta_sha256"


def sealed(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` as JSON will read it back, with its SHA-256 under ``meta_sha256``."""
    meta = json.loads(json.dumps(meta))  # tuples as lists, keys as strings: what is read back
    return {**meta, _SEAL: _digest(meta)}


def check_sealed(meta: Any) -> dict[str, Any]:
    """``meta`` if it is this format and matches its SHA-256; else :class:`CheckpointError`."""
    if not isinstance(meta, dict) or meta.get("format") not in READ:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(
            f"meta is format {found!r}; jaxdp {_version()} reads checkpoint formats 2 "
            f"(written by jaxdp 0.2, converted as it is read) and {FORMAT}. Format 1, "
            "written before the metadata had a checksum, is not read"
        )
    body = {k: v for k, v in meta.items() if k != _SEAL}
    if meta.get(_SEAL) != _digest(body):
        raise CheckpointError(
            "meta does not match its SHA-256: the position, batch, seed or configuration it "
            "holds changed after it was written"
        )
    return body


def _version() -> str:
    from .. import __version__

    return __version__


def _digest(meta: dict[str, Any]) -> str:
    text = json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def array_sha256(x: jax.Array | np.ndarray, shape: Any = None) -> str | None:
    """SHA-256 of the value's bytes; None where this process cannot see all of it.
    ``shape``: of a leaf held padded (ZeRO stage 3), the model's shape, whose part of the
    value (the first ``shape`` elements along each dimension) is hashed, whatever the
    padding of the layout that wrote or read it."""
    if isinstance(x, (np.ndarray, np.generic)):  # a background save's host copy
        value = x
    elif x.is_fully_addressable:
        value = np.asarray(x)
    elif x.sharding.is_fully_replicated:
        value = np.asarray(x.addressable_data(0))
    else:
        return None  # another process holds part of it; orbax's own checks apply
    if shape is not None and tuple(shape) != value.shape:
        value = value[tuple(slice(0, n) for n in shape)]
    # Over the array's own bytes, not a copy (``tobytes``): hashlib then releases the GIL
    # for the whole digest, so a background save's hashing leaves the training loop be.
    data = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    return hashlib.sha256(data).hexdigest()


def check_sha256(tree: Any, leaves: dict[str, Any], read: Callable[[str], bool]) -> None:
    """Raises :class:`CheckpointError` for the first leaf of ``tree`` that was ``read``
    and does not match the SHA-256 in ``leaves`` (meta's)."""
    for name, x in named(tree):
        saved = leaves.get(name, {})
        expected = saved.get("sha256")
        if read(name) and expected is not None:
            actual = array_sha256(x, saved.get("shape"))
            if actual is not None and actual != expected:
                raise CheckpointError(f"{name} does not match its SHA-256")

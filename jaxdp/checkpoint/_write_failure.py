"""What a failed checkpoint write says: one line, the cause in the operating system's words.

orbax writes through tensorstore, whose errors arrive as a ``ValueError`` with
kilobytes of context (``RESOURCE_EXHAUSTED: Error writing "..." in OCDBT
database ...: No space left on device [os_error_code='28']``), after each of
orbax's writer threads has logged the same exception with its traceback.
"""

from __future__ import annotations

import errno
import logging
import os
import re

# Out of room: a full device, a quota, a file size limit (RLIMIT_FSIZE).
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def no_room(error: BaseException) -> str | None:
    """The OS's words if ``error`` (or what caused it) is a full disk, quota or size limit.

    ``"No space left on device (ENOSPC)"``; None for any other failure.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        code = current.errno if isinstance(current, OSError) else None
        if code is None:
            found = _OS_ERROR_CODE.search(str(current))
            code = int(found.group(1)) if found else None
        if code in _NO_ROOM:
            return f"{os.strerror(code)} ({errno.errorcode[code]})"
        current = current.__cause__ or current.__context__
    return None


def quiet_writer_thread_logs() -> None:
    """Drops orbax's log of an exception in one of its writer threads (once per process).

    orbax logs it with a traceback and then raises the very exception in the
    thread that waits for the write, where :meth:`Checkpoints.save` reports it
    in one line; the log only repeats it, once per thread.
    """
    log = logging.getLogger("absl")
    if not any(isinstance(f, _QuietWriterThreads) for f in log.filters):
        log.addFilter(_QuietWriterThreads())


class _QuietWriterThreads(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "_SignalingThread.run() raised an exception" not in str(record.msg)

"""A process's heartbeat for ``jaxdp launch``: a file touched every second.

:func:`jaxdp.initialize` starts it when ``JAXDP_HEARTBEAT_FILE`` names a file
(the launcher sets it). The launcher reads the file's modification time: one
older than its ``--hang-timeout-s`` means the process stopped answering (a
SIGSTOP, a process frozen in the kernel), and the group is restarted. A daemon
thread that only sleeps and touches a file: it needs the GIL for microseconds,
and a process that runs at all runs it.
"""

from __future__ import annotations

import os
import pathlib
import threading
import time

INTERVAL_S = 1.0
_started: set[str] = set()
_lock = threading.Lock()


def start_heartbeat(path: str) -> None:
    """Touches ``path`` now and then every :data:`INTERVAL_S` seconds, from a daemon thread
    (once per path and process)."""
    with _lock:
        if path in _started:
            return
        _started.add(path)
    file = pathlib.Path(path)
    file.touch()  # the first beat, before the caller goes on: it is watched from now

    def beat() -> None:  # ends with the process
        while True:
            time.sleep(INTERVAL_S)
            try:
                os.utime(file)
            except OSError:
                file.touch()  # removed meanwhile: the launcher still reads a beat

    threading.Thread(target=beat, name="jaxdp-heartbeat", daemon=True).start()

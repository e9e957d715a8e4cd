"""The ``jaxdp`` command line: ``train``, ``launch``, ``parity``, ``plan``.

Its own dependencies (scikit-learn for the digits images, tqdm, matplotlib) come
with the ``cli`` extra: ``pip install 'jaxdp[cli]'``.
"""

from ._interrupt import quiet_workers as _quiet_workers
from ._main import main as main

__all__ = ["main"]

_quiet_workers()  # in the DDP ranks jaxdp parity spawns: Ctrl-C is the command's to report

"""The ``jaxdp`` command line: ``train``, ``launch``, ``parity``, ``plan``.

Its own dependencies (scikit-learn for the digits images, tqdm, matplotlib) come
with the ``cli`` extra: ``pip install 'jaxdp[cli]'``.
"""

from ._main import main as main

__all__ = ["main"]

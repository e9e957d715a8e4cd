"""``python -m jaxdp``: the ``jaxdp`` command line."""

import sys

from .cli import main

sys.exit(main())

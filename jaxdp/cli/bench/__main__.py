"""``python -m jaxdp.cli.bench [--quick] [--out DIR] [--only NAME]``: ``jaxdp bench``."""

import sys

from .._main import main

sys.exit(main(["bench", *sys.argv[1:]]))

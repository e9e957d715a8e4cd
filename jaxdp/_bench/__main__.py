"""``python -m jaxdp._bench [--quick] [--out DIR] [--only NAME]``: the same as ``jaxdp bench``."""

import sys

from .._cli import main

sys.exit(main(["bench", *sys.argv[1:]]))

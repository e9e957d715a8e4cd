"""``python -m jaxdp``: the ``jaxdp`` command line."""

import sys

from .cli import main

# Guarded: the DDP ranks `jaxdp parity --num-devices 2` starts (torch's spawn) import
# __main__ again, and must not run the command line once more.
if __name__ == "__main__":
    sys.exit(main())

"""``python -m jaxdp``: the ``jaxdp`` command line."""

import sys

from jaxdp.cli import main

# Guarded: the DDP ranks `jaxdp parity --num-devices 2` starts (torch's spawn) import
# __main__ again, and must not run the command line once more.
if __name__ == "__main__":
    # multiprocessing's spawn skips a package's __main__ module when it prepares a rank;
    # named by its path instead (no spec), this file runs there as __mp_main__ (the import
    # above only), so a rank takes the command line's quiet Ctrl-C (jaxdp.cli._interrupt)
    # before it imports torch, as under the `jaxdp` script.
    sys.modules["__main__"].__spec__ = None
    sys.exit(main())

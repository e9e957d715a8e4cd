"""Testing sharded code: the collectives of a compiled program (:func:`all_reduces`,
:func:`collectives`, :func:`format_report`: how often, how big, what runs under them),
assertion helpers, a mesh of compile-only GPUs to compile a step for (:func:`gpu_mesh`),
and (in the ``jaxdp_pytest`` module, loaded by pytest wherever jaxdp is installed;
``-p no:jaxdp`` turns it off) the pytest plugin of ``@pytest.mark.devices(n)`` and
``@pytest.mark.devices(n, processes=p)``. See docs/testing.md.
"""

from .._inspect import AllReduce as AllReduce
from .._inspect import Collective as Collective
from .._inspect import Instruction as Instruction
from .._inspect import all_reduces as all_reduces
from .._inspect import collectives as collectives
from .._inspect import format_report as format_report
from .._inspect import instructions as instructions
from .._options import plain_spelling as plain_spelling
from ._collectives import Buckets as Buckets
from ._collectives import assert_collectives as assert_collectives
from ._gpu import TARGETS as TARGETS
from ._gpu import gpu_mesh as gpu_mesh
from ._trees import TOLERANCES as TOLERANCES
from ._trees import Tolerance as Tolerance
from ._trees import assert_trees_close as assert_trees_close

__all__ = [
    # The collectives of a compiled program
    "all_reduces",
    "AllReduce",
    "collectives",
    "Collective",
    "format_report",
    "instructions",
    "Instruction",
    # Assertions
    "assert_trees_close",
    "Tolerance",
    "TOLERANCES",
    "assert_collectives",
    "Buckets",
    # The GPU's spelling of the step on a CPU mesh
    "plain_spelling",
    # GPU programs compiled without a GPU
    "gpu_mesh",
    "TARGETS",
]

"""Testing sharded code: assertion helpers, and (in the ``jaxdp_pytest`` module, loaded by
pytest wherever jaxdp is installed; ``-p no:jaxdp`` turns it off) the pytest plugin of
``@pytest.mark.devices(n)`` and ``@pytest.mark.devices(n, processes=p)``. See docs/testing.md.
"""

from .._options import plain_spelling as plain_spelling
from ._collectives import assert_collectives as assert_collectives
from ._trees import TOLERANCES as TOLERANCES
from ._trees import Tolerance as Tolerance
from ._trees import assert_trees_close as assert_trees_close

__all__ = ["assert_trees_close", "Tolerance", "TOLERANCES", "assert_collectives", "plain_spelling"]

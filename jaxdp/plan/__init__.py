"""Memory planning: what a data-parallel step holds per device, which micro-batch
fits, and what an optimizer step sends.

``plan_memory(params=..., device_memory=..., num_devices=...)`` is the
closed-form estimate (the command line's ``jaxdp plan``);
``compiled_memory(step.compile(state, batch))`` reads XLA's own figures of a
compiled step. Everything not re-exported here is private.
"""

from ._memory import DTYPE_POLICIES as DTYPE_POLICIES
from ._memory import OPTIMIZER_MOMENTS as OPTIMIZER_MOMENTS
from ._memory import DtypePolicy as DtypePolicy
from ._memory import MemoryPlan as MemoryPlan
from ._memory import parse_bytes as parse_bytes
from ._memory import plan_memory as plan_memory
from ._memory import ring_all_reduce_bytes as ring_all_reduce_bytes
from ._xla import CompiledMemory as CompiledMemory
from ._xla import activation_bytes as activation_bytes
from ._xla import compiled_memory as compiled_memory

__all__ = [
    "DTYPE_POLICIES",
    "OPTIMIZER_MOMENTS",
    "CompiledMemory",
    "DtypePolicy",
    "activation_bytes",
    "MemoryPlan",
    "compiled_memory",
    "parse_bytes",
    "plan_memory",
    "ring_all_reduce_bytes",
]

"""GPU programs without a GPU: a mesh of compile-only NVIDIA devices, described on a
CPU machine, for which XLA:GPU compiles a step in full (SPMD partitioning, its collective
combiners, the latency-hiding scheduler, buffer assignment, the kernels for the GPU's
architecture). The compiled program's text is its schedule, and its memory analysis is
per device: what runs under each collective and each device's peak can be read without
the GPUs (docs/scaling-out.md, "Reading the program for your GPUs").
"""

from __future__ import annotations

import importlib.resources
import os
import re
from pathlib import Path

import numpy as np
from jax.sharding import Mesh

from .._mesh import DATA_AXIS

TARGETS = ("h100-sxm", "h100")
"""The GPUs described here (``targets/NAME.txtpb``, XLA's ``GpuTargetConfigProto``):
``"h100-sxm"``, an H100 80GB HBM3 with its 18 NVLink links (XLA then runs small all-reduces
within a node with its own one-shot and two-shot kernels); ``"h100"``, the same without
the links' description (the config of openxla/xla's pull request 25919)."""

_TOPOLOGY = re.compile(r"^[1-9]\d*x[1-9]\d*x[1-9]\d*$")
_PACKAGES = "jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v} nvidia-cuda-nvcc-cu12"


def gpu_mesh(
    topology: str = "1x1x8", *, target: str = "h100-sxm", axis_name: str = DATA_AXIS
) -> Mesh:
    """A one-axis mesh of compile-only NVIDIA GPUs, in ``jax.devices()`` order.

    ``topology``: ``"<slices>x<hosts per slice>x<GPUs per host>"``: one node of 8 GPUs is
    ``"1x1x8"``, two nodes of 8 ``"1x2x8"`` (their devices belong to 2 processes, as in a
    run on two hosts). ``target``: one of :data:`TARGETS`, or the path of a
    ``GpuTargetConfigProto`` text file (on a GPU,
    ``jax._src.lib.xla_client.get_topology_for_devices(jax.devices()).target_config``
    gives the one of the GPU at hand).

    A step made on this mesh compiles for those GPUs from abstract inputs only (nothing
    can be placed on them): ``step.compile(step.abstract_state(model), batch)`` with the
    batch as ``jax.ShapeDtypeStruct`` s. Read what runs under each collective with
    :func:`jaxdp.testing.collectives`, and each device's memory with
    :func:`jaxdp.plan.compiled_memory`.

    Needs jax's CUDA plugin for the jax in use, with a ``ptxas`` (no driver, no GPU):
    ``pip install jax-cuda12-plugin==V jax-cuda12-pjrt==V nvidia-cuda-nvcc-cu12`` for jax
    ``V`` (bin/test-newest-jax installs them so), and ``JAX_PLATFORMS=cpu`` in the environment
    before JAX starts (else the plugin looks for a driver). Emulated CPU devices work in
    the same process.

    Raises:
      ValueError: ``topology`` or ``target`` is not one of the forms above, or XLA:GPU
        cannot read ``target``'s file (where it describes the topology for a target of
        :data:`TARGETS`).
      RuntimeError: XLA:GPU cannot describe the topology here, with what to install or set.
    """
    if not isinstance(topology, str) or not _TOPOLOGY.match(topology):
        raise ValueError(
            f"topology={topology!r} must be '<slices>x<hosts per slice>x<GPUs per host>', "
            "e.g. '1x1x8' (one node of 8 GPUs) or '1x2x8' (two nodes of 8)"
        )
    config = _target_config(target)
    import jax
    from jax.experimental import topologies

    try:
        described = topologies.get_topology_desc(
            platform="cuda", target_config=config, topology=topology
        )
    except Exception as error:  # the plugin's own errors name no remedy
        if target not in TARGETS and _describes(topology):  # the plugin works: the file
            raise ValueError(
                f"target={target!r}: XLA:GPU cannot read this file as a GpuTargetConfigProto "
                f"text file ({error}); the targets {TARGETS} describe {topology!r} here"
            ) from error
        packages = _PACKAGES.format(v=jax.__version__)
        platforms = os.environ.get("JAX_PLATFORMS")
        raise RuntimeError(
            f"gpu_mesh({topology!r}): XLA:GPU cannot describe the topology here ({error}). "
            f"It needs jax's CUDA plugin with a ptxas (pip install {packages}) and "
            f"JAX_PLATFORMS=cpu set before JAX starts (JAX_PLATFORMS is {platforms!r})"
        ) from error
    return Mesh(np.array(described.devices), (axis_name,))


def _describes(topology: str) -> bool:
    """Whether XLA:GPU describes ``topology`` for a target of ours: its CUDA plugin works."""
    from jax.experimental import topologies

    try:
        topologies.get_topology_desc(
            platform="cuda", target_config=_target_config("h100"), topology=topology
        )
    except Exception:
        return False
    return True


def _target_config(target: str) -> str:
    if target in TARGETS:
        return (importlib.resources.files(__package__) / "targets" / f"{target}.txtpb").read_text()
    path = Path(target) if isinstance(target, (str, os.PathLike)) else None
    if path is None or not path.is_file():
        raise ValueError(
            f"target={target!r} must be one of {TARGETS} or the path of a "
            "GpuTargetConfigProto text file"
        )
    return path.read_text()

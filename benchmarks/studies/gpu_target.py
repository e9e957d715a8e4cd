"""On a lent GPU: the GPU's own target config, and the GPT-2-small step compiled on the
device beside the same step compiled for it deviceless (as a CPU machine compiles it,
``jaxdp.testing.gpu_mesh``), to see what a compile without the device gets right.

Run on the GPU machine (step 0 of ``benchmarks/gpu_checks.py``)::

    python3 benchmarks/studies/gpu_target.py --out DIR

Writes ``DIR/target_config.txtpb`` (``get_topology_for_devices(jax.devices()).target_config``,
the file ``gpu_mesh(target=PATH)`` takes) and ``DIR/gpu_target.json``: for each compile,
XLA's memory analysis, the number of GEMM and other kernels, the collectives (none on one
device), and whether the scheduled programs are the same instruction for instruction once
names are set aside. A deviceless compile cannot autotune, so its GEMM choices may differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import pathlib
import re
import sys
import time
from collections import Counter

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout


def _summary(compiled) -> dict:
    from jaxdp.plan import compiled_memory
    from jaxdp.testing import collectives

    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    kinds = Counter(re.findall(r"= \S+ (fusion|custom-call)\(", entry))
    gemms = len(re.findall(r"gemm|cublas", entry))
    shape = re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", entry))
    return {
        "memory": dataclasses.asdict(compiled_memory(compiled)),
        "kernels": dict(kinds),
        "gemm_mentions": gemms,
        "collectives": len(collectives(compiled)),
        "shape_hash": hashlib.sha256(shape.encode()).hexdigest()[:16],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=pathlib.Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax._src.lib import xla_client
    from jax.experimental import topologies
    from jax.sharding import Mesh

    import jaxdp
    from benchmarks.harness.gpu import GPT2_SMALL, nnx_loss, nnx_model

    if jax.devices()[0].platform != "gpu":
        print("no GPU", file=sys.stderr)
        return 2
    config = xla_client.get_topology_for_devices(jax.devices()[:1]).target_config
    (args.out / "target_config.txtpb").write_text(str(config))
    described = topologies.get_topology_desc(
        platform="cuda", target_config=str(config), topology="1x1x1"
    )
    model = nnx.eval_shape(lambda: nnx_model(GPT2_SMALL, dtype=jnp.bfloat16))
    batch = (jax.ShapeDtypeStruct((8, GPT2_SMALL.block_size), jnp.int32),) * 2
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    for name, devices in (("on_device", jax.devices()[:1]), ("deviceless", described.devices)):
        mesh = Mesh(np.array(devices), ("data",))
        step = jaxdp.make_train_step(nnx_loss, optax.adamw(3e-4), mesh=mesh)
        started = time.perf_counter()
        compiled = step.compile(step.abstract_state(model), batch)
        result[name] = _summary(compiled) | {"compile_seconds": time.perf_counter() - started}
    result["same_program"] = result["on_device"]["shape_hash"] == result["deviceless"]["shape_hash"]
    (args.out / "gpu_target.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

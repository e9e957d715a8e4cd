"""The jaxdp half of ``vs_torch``, run in a worker process of its own (``_worker``).

Every stepper makes one optimizer step (or one component of it) and ends by
reading the loss on the host, as torch_ref's ``loss.item()`` does: timed
calls are synchronized on both sides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._common import BenchModel, micro_loss, optimizer


def _placed(bm: BenchModel, rows: int, mesh: Any) -> Any:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.device_put(bm.data(rows), NamedSharding(mesh, P(mesh.axis_names[0])))


def jaxdp_stepper(
    bm: BenchModel,
    *,
    num_devices: int,
    accum_steps: int,
    zero_stage: int = 0,
    comm_dtype: str | None = None,
    parallel: dict[str, Any] | None = None,
    memory: bool = False,
) -> Callable[[], float]:
    """jaxdp's fused step on a pre-placed global batch (at a ZeRO stage, with a
    communication dtype: the ``zero`` measurement; ``parallel``: more of
    :class:`jaxdp.Parallel`'s fields, e.g. ``regather`` or ``shards``, the ``zero3``
    one). ``memory``: the stepper's ``facts`` are XLA's per-device figures
    (:func:`.zero.memory_facts`); the step compiled for them is the one the stepper
    calls."""
    from jaxdp import Parallel, data_mesh, make_train_step

    mesh = data_mesh(num_devices)
    fields = {"zero_stage": zero_stage, "comm_dtype": comm_dtype} | (parallel or {})
    step = make_train_step(
        bm.loss, optimizer(), mesh=mesh, accum_steps=accum_steps, parallel=Parallel(**fields)
    )
    batch = _placed(bm, num_devices * accum_steps * bm.micro_batch_size, mesh)
    box = [step.init(bm.make())]
    facts = None
    if memory:
        from .zero import memory_facts

        facts = memory_facts(bm, step, box[0], batch, mesh, accum_steps, Parallel(**fields))

    def run() -> float:
        box[0], metrics = step(box[0], batch)
        # Reading the loss each step, as a training loop logs it; it also keeps
        # XLA's in-process CPU all-reduce from stalling under queued steps.
        return float(metrics["loss"])

    run.facts = facts  # type: ignore[attr-defined]
    return run


def hand_written_stepper(
    bm: BenchModel, *, num_devices: int, accum_steps: int
) -> Callable[[], float]:
    """The hand-written floor (:mod:`._hand_written`) on the same batch."""
    import jax

    from jaxdp import data_mesh

    from ._hand_written import hand_written_step, replicated

    mesh = data_mesh(num_devices)
    loss, params = micro_loss(bm, bm.make())
    step = hand_written_step(loss, optimizer(), mesh, accum_steps)
    batch = _placed(bm, num_devices * accum_steps * bm.micro_batch_size, mesh)
    params = jax.tree.map(jax.numpy.copy, params)
    box = list(replicated(mesh, (params, optimizer().init(params))))

    def run() -> float:
        box[0], box[1], value = step(box[0], box[1], batch)
        return float(value)

    return run


def component_steppers(bm: BenchModel) -> dict[str, Callable[[], float]]:
    """One micro-batch's forward, backward and ``acc += grads`` (one jitted call), and
    one optimizer update: the parts of a step, to set against torch's."""
    import jax
    import jax.numpy as jnp
    import optax

    loss, params = micro_loss(bm, bm.make())
    opt = optimizer()

    def accumulate(acc, params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return jax.tree.map(jnp.add, acc, grads), value

    def apply(params, opt_state, grads):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jnp.zeros([])

    micro = jax.jit(accumulate, donate_argnums=0)
    update = jax.jit(apply, donate_argnums=(0, 1))
    batch = jax.device_put(bm.data(bm.micro_batch_size))
    grads = jax.tree.map(jnp.ones_like, params)
    acc = [jax.tree.map(jnp.zeros_like, params)]
    box = [jax.tree.map(jnp.copy, params)]
    box.append(opt.init(box[0]))

    def run_micro() -> float:
        acc[0], value = micro(acc[0], params, batch)
        return float(value)

    def run_update() -> float:
        box[0], box[1], value = update(box[0], box[1], grads)
        return float(value)

    return {"micro": run_micro, "update": run_update}

"""One training script for one process or many: ``jaxdp.initialize``, then each
process feeds only its own rows of every global batch.

Under ``jaxdp launch`` (or Slurm, Open MPI, torchrun-like launchers that set
the ``JAXDP_*`` variables) ``jaxdp.initialize`` joins the processes into one
JAX run and returns the mesh over all their devices; alone it does nothing
more than build the mesh. ``jaxdp.process_share`` says which rows of each
global batch this process reads; the step assembles the global batch across
processes (``jax.make_array_from_process_local_data``) and all-reduces the
gradients once per optimizer step (gloo between CPU processes, NCCL on GPUs).
Only process 0 prints.

Run::

    python examples/multi_process.py                                            # 1 x 4 devices
    jaxdp launch --nprocs 2 --devices-per-process 2 -- examples/multi_process.py  # 2 x 2

Expected output (the same numbers both ways; one process reads all 5120 rows)::

    processes: 2 x 2 device(s)
    batch: global_batch_size=128 = num_devices=4 x accum_steps=2 x micro_batch_size=16
    this process read 2560 of the 5120 rows of 40 optimizer steps
    loss 3.9233 -> 0.0345
    w: [-0.9 -0.7 -0.4 -0.1  0.1  0.5  0.7  0.9], b: 0.5

(under ``jaxdp launch`` each line carries the prefix ``[rank 0]``).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxdp


def loss_fn(params, batch):
    """Mean squared error of one micro-batch of a linear fit."""
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the same (it is quick)")
    parser.parse_args()

    jaxdp.emulate_cpu_devices(4)  # CPU, one process; jaxdp launch sets each process's count
    mesh = jaxdp.initialize()  # joins the other processes, if any; the mesh over all devices
    sizes = jaxdp.batch_sizes(num_devices=mesh.devices.size, accum_steps=2, micro_batch_size=16)
    share = jaxdp.process_share(mesh, sizes)  # this process's rows of every global batch
    if jax.process_index() == 0:
        print(f"processes: {share.process_count} x {share.sizes.num_devices} device(s)")
        print(f"batch: {sizes.describe()}")

    # Every process can index the whole data set, and reads only its rows of it.
    x = np.random.default_rng(0).normal(size=(1024, 8)).astype(np.float32)
    y = x @ np.linspace(-1, 1, 8, dtype=np.float32)[:, None] + 0.5
    step = jaxdp.make_train_step(loss_fn, optax.adam(0.1), mesh=mesh, accum_steps=2)
    state = step.init({"w": np.zeros((8, 1), np.float32), "b": np.zeros(1, np.float32)})
    losses, read = [], 0
    for epoch in range(5):
        for rows in jaxdp.epoch_schedule(len(x), sizes, epoch=epoch).rows:  # every rank's rows
            mine = rows[share.rows]  # the rows of this process's devices
            state, metrics = step(state, (x[mine], y[mine]))
            losses.append(float(metrics["loss"]))  # the global batch's loss
            read += len(mine)
    if jax.process_index() == 0:
        print(
            f"this process read {read} of the {len(losses) * sizes.global_batch_size} rows "
            f"of {len(losses)} optimizer steps"
        )
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        w, b = (np.asarray(state.params[k]).ravel() for k in ("w", "b"))
        print(f"w: {np.array2string(w, precision=1)}, b: {b[0]:.1f}")


if __name__ == "__main__":
    main()

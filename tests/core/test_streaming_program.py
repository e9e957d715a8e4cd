"""The multisteps path's speed, read from its compiled program (no timing): a call that
does not emit runs the micro-batch's forward and backward and ``acc += grads``, and no
optimizer arithmetic, no parameter-sized select and no parameter-sized copy."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import mlp_params, mse_loss, regression_data

import jaxdp
from jaxdp._inspect import instructions

# Parameter shapes ([8, 24], [24], [24, 5], [5]) that no activation of a 2-row
# micro-batch shares, so a parameter-sized instruction is one over parameters.
SIZES = (8, 24, 5)
MICRO = 2
# What an optimizer computes and accumulation never needs (Adam: the square root
# of the second moment and the division by it), and what masking costs.
OPTIMIZER_OPS = {"sqrt", "rsqrt", "divide", "power"}
MASKING_OPS = {"select", "copy"}


def dims(shape: str) -> tuple[int, ...]:
    """``"f64[1,24,5]"`` -> ``(24, 5)``: leading unit axes (a device's block) dropped."""
    found = [int(d) for d in re.search(r"\[([\d,]*)\]", shape).group(1).split(",") if d]
    while found and found[0] == 1 and len(found) > 1:
        found.pop(0)
    return tuple(found)


def parameter_sized(compiled, ops, params) -> list[str]:
    """The instructions with an opcode in ``ops`` over a parameter's shape that a call
    runs when every conditional takes branch 0 (a ``lax.cond``'s false branch: for
    jaxdp's step, the call does not emit)."""
    shapes = {tuple(np.shape(x)) for x in jax.tree.leaves(params)}
    found = []
    for i in instructions(compiled):
        branches = [c for c in i.context if c.startswith("conditional")]
        taken = all(c.endswith("[0]") for c in branches)
        if i.opcode in ops and taken and any(dims(s) in shapes for s in i.shapes):
            found.append(f"{i.opcode} {i.name} {i.shapes} {' > '.join(i.context)}")
    return found


def multisteps(**options):
    num_devices = options.pop("num_devices", 4)
    step = jaxdp.make_train_step(
        mse_loss,
        optax.adamw(1e-2, weight_decay=1e-2),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=4,
        path="multisteps",
        **options,
    )
    params = mlp_params(sizes=SIZES)
    state = step.init(params)
    batch = regression_data(num_devices * MICRO, sizes=SIZES)
    return step.compile(state, batch), params


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"parallel": jaxdp.Parallel(strategy="pmap")},
        {"num_devices": 1},
        {"skips": jaxdp.Skips(nonfinite=False)},
        {"skips": jaxdp.Skips(unused=True)},
        {"trainable": {"b0": True, "b1": False, "w0": False, "w1": True}},
    ],
    ids=["shard_map", "pmap", "one_device", "no_skip", "skip_unused", "frozen"],
)
def test_a_call_that_does_not_emit_only_accumulates(options):
    compiled, params = multisteps(**options)
    # The all-reduce sits in branch 1, the emitting call's ...
    (reduce,) = jaxdp.testing.all_reduces(compiled)
    assert [c[-3:] for c in reduce.context if c.startswith("conditional")] == ["[1]"]
    # ... and branch 0 holds nothing over the parameters but the sums' update.
    assert parameter_sized(compiled, OPTIMIZER_OPS | MASKING_OPS, params) == []
    trained = sum(jax.tree.leaves(options.get("trainable", jax.tree.map(lambda _: 1, params))))
    assert len(parameter_sized(compiled, {"add"}, params)) >= trained  # acc += grads


def test_the_emitting_branch_holds_the_optimizer():
    """The check can see optimizer arithmetic: the emitting branch has it."""
    compiled, params = multisteps()
    shapes = {tuple(np.shape(x)) for x in jax.tree.leaves(params)}
    emitting = [
        i.opcode
        for i in instructions(compiled)
        if any(c.endswith("[1]") for c in i.context) and any(dims(s) in shapes for s in i.shapes)
    ]
    assert OPTIMIZER_OPS & set(emitting)


def test_optax_multisteps_alone_masks_every_call():
    """What the check guards against: optax.MultiSteps (0.2.8) runs Adam on every call
    and keeps or drops its result with selects over the parameters' shapes."""
    params = jax.tree.map(jnp.asarray, mlp_params(sizes=SIZES))
    optimizer = optax.MultiSteps(optax.adam(1e-2), 4)

    def step(params, opt_state, batch):
        grads = jax.grad(mse_loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    batch = regression_data(MICRO, sizes=SIZES)
    compiled = jax.jit(step).lower(params, optimizer.init(params), batch).compile()
    found = {f.split()[0] for f in parameter_sized(compiled, OPTIMIZER_OPS | MASKING_OPS, params)}
    assert {"sqrt", "select"} <= found


def test_the_window_is_one_record_that_restarts_at_zero():
    """The open window lives in state.window: its position counts the micro-batches
    added, ``metrics["emitted"]`` marks the call that ends it, and the sums restart at
    exactly +0 after each update (they are written in place, see test above)."""
    num_devices, accum_steps = 2, 3
    step = jaxdp.make_train_step(
        mse_loss,
        optax.adamw(1e-2, weight_decay=1e-2),
        mesh=jaxdp.data_mesh(num_devices),
        accum_steps=accum_steps,
        path="multisteps",
    )
    params = jax.tree.map(jnp.asarray, mlp_params(sizes=SIZES))
    state = step.init(params)
    assert isinstance(state.window, jaxdp.Window)
    for x, p in zip(jax.tree.leaves(state.window.grads), jax.tree.leaves(params), strict=True):
        assert x.shape == (num_devices, *p.shape)  # one row of sums per device
    emitted, positions, sums = [], [], []
    batch = regression_data(num_devices * MICRO, sizes=SIZES)
    for _ in range(2 * accum_steps):
        state, metrics = step(state, batch)
        emitted.append(bool(metrics["emitted"]))
        positions.append(int(state.window.position))
        sums.append(max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(state.window.grads)))
    assert emitted == [False, False, True] * 2
    assert positions == [1, 2, 0] * 2
    assert int(state.step) == 2
    assert [s == 0 for s in sums] == emitted
    for x in jax.tree.leaves(state.window.grads):
        assert not np.signbit(np.asarray(x)).any()

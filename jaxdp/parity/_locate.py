"""The divergence locator: from torch's weights before one optimizer step, the first stage
of that step where the port departs from torch, and what departs there.

Stages, in order: the forward outputs and the loss of every micro-batch (module by
module where the outputs differ), each micro-batch's gradients, the accumulated and
all-reduced gradient (jaxdp's own step on the JAX side, DDP's mean on the torch side),
and the optimizer update (both optimizers replayed from step 1 on torch's gradients).
torch runs in this process: DDP's gradient is the mean over ranks of each rank's
``sum_j grad(loss_j) / accum_steps``, computed here micro-batch by micro-batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._forward import split_model
from .._frozen import _named, split_trainable, trainable_mask
from .._layout import micro_batches
from .._mesh import data_mesh
from .._step import make_train_step
from ._locate_text import Divergence, StageDiff, notes_for
from ._port import Port
from ._runner import sizes_of, step_batches
from ._trace import culprit, differs, jax_calls, torch_calls

STAGES = ("forward", "loss", "micro-batch gradients", "accumulated gradients", "optimizer update")


def locate(
    port: Port, torch_states: list[dict[str, np.ndarray]], step: int, rtol: float, atol: float
) -> Divergence:
    """The locator's finding at optimizer ``step`` (1-based) of ``port``'s run, whose torch
    states after every step are ``torch_states`` (torch's layout)."""
    with jax.default_matmul_precision("highest"):
        return _Locator(port, torch_states, rtol, atol).run(step)


class _Pass(NamedTuple):
    outputs: list[np.ndarray]
    losses: list[float]
    grads: list[dict[str, np.ndarray]]  # per micro-batch, JAX layout


class _Locator:
    def __init__(self, port: Port, torch_states: list[dict[str, np.ndarray]], rtol, atol):
        import torch_ref
        from torch_ref.user import build_user_model, loss_function

        self.port, self.states, self.rtol, self.atol = port, torch_states, rtol, atol
        self.torch_loss = loss_function(port.torch_loss)
        self.build = lambda: build_user_model(
            port.torch_model, seed=port.config.seed, dtype=_torch_dtype(port.config.dtype)
        )
        config = dataclasses.replace(port.config, steps=len(torch_states))
        self.batches = list(
            step_batches(config, port.data, torch_ref.torch_permutation, slice(None))
        )
        self.compared = self._compared()
        self.trace_lines: list[str] = []

    def _compared(self) -> list[str]:
        """The JAX parameters whose torch tensor has a gradient (requires_grad)."""
        trainable = {n for n, p in self.build().named_parameters() if p.requires_grad}
        params = self.port.weights.params
        if self.port.weights.function is not None:
            return [p for p in params if p not in self.port.weights.frozen]
        return [p for p in params if self.port.weights.torch_name(p) in trainable]

    def run(self, step: int) -> Divergence:
        state = self.before(step)
        micro = self.micro(step)
        theirs, ours = self.torch_pass(state, micro), self.jax_pass(state, micro)
        stages = [self.forward(theirs, ours), self.loss(theirs, ours)]
        stages.append(self.grads("micro-batch gradients", ours.grads, theirs.grads))
        module = None
        if stages[0].beyond:
            module = self.trace(state, micro[_first_bad(theirs, ours, self)][0])
        if all(s.passed for s in stages):
            stages.append(self.accumulated(step, theirs))
        if all(s.passed for s in stages):
            stages.append(self.optimizer(step))
        return self.finding(step, stages, module, theirs, ours)

    # ---- inputs ------------------------------------------------------------------------------

    def before(self, step: int) -> dict[str, np.ndarray]:
        """torch's state_dict before ``step``."""
        return self.port.initial if step == 1 else self.states[step - 2]

    def micro(self, step: int) -> list[tuple[np.ndarray, np.ndarray, float]]:
        """``(x, y, weight)`` of every rank's micro-batches of ``step``, rank-major."""
        n, k, b, _ = sizes_of(self.port.config)
        (x, y), weights = self.batches[step - 1]
        x, y = (a.reshape(n, k, b, *a.shape[1:]) for a in (x, y))
        return [(x[r, j], y[r, j], float(weights[j])) for r in range(n) for j in range(k)]

    # ---- both sides, micro-batch by micro-batch ----------------------------------------------

    def torch_model(self, state: dict[str, np.ndarray]) -> Any:
        import torch

        model = self.build()
        model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()}, strict=True)
        return model.train()

    def torch_pass(self, state: dict[str, np.ndarray], micro: list) -> _Pass:
        import torch

        model, out = self.torch_model(state), _Pass([], [], [])
        for x, y, _ in micro:
            model.zero_grad(set_to_none=True)
            output = model(torch.as_tensor(x))
            loss = self.torch_loss(output, torch.as_tensor(y))
            loss.backward()
            grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
            out.outputs.append(output.detach().numpy())
            out.losses.append(loss.item())
            out.grads.append(self.to_jax(grads))
        return out

    def to_jax(self, torch_grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """torch gradients in the JAX layout (zeros for tensors without one)."""
        full = {k: torch_grads.get(k, np.zeros_like(v)) for k, v in self.port.initial.items()}
        converted = self.port.weights.to_jax(full)
        return {name: converted[name] for name in self.compared}

    def jax_module(self, state: dict[str, np.ndarray]) -> Any:
        """The port holding torch's ``state``."""
        return self.port.weights.load(
            self.port.jax_module, state, jnp.dtype(self.port.config.dtype)
        )

    def jax_pass(self, state: dict[str, np.ndarray], micro: list) -> _Pass:
        params, forward = self.port.weights.framework.apply(self.jax_module(state))

        def objective(params, x, y):
            output = forward(params, x)
            return self.port.jax_loss(output, y), output

        grad = jax.jit(jax.value_and_grad(objective, has_aux=True))
        out = _Pass([], [], [])
        for x, y, _ in micro:
            (loss, output), grads = grad(params, x, y)
            flat = flat_arrays(grads)
            out.outputs.append(np.asarray(output))
            out.losses.append(float(loss))
            out.grads.append({name: flat[name] for name in self.compared})
        return out

    # ---- stages ------------------------------------------------------------------------------

    def forward(self, theirs: _Pass, ours: _Pass) -> StageDiff:
        named = {f"output of micro-batch {i}": v for i, v in enumerate(theirs.outputs)}
        mine = {f"output of micro-batch {i}": v for i, v in enumerate(ours.outputs)}
        return self.diff("forward", mine, named)

    def loss(self, theirs: _Pass, ours: _Pass) -> StageDiff:
        named = {f"loss of micro-batch {i}": v for i, v in enumerate(theirs.losses)}
        mine = {f"loss of micro-batch {i}": v for i, v in enumerate(ours.losses)}
        return self.diff("loss", mine, named)

    def grads(self, stage: str, ours: list[dict], theirs: list[dict]) -> StageDiff:
        """The worst over micro-batches, per parameter."""
        results = [self.diff(stage, a, b) for a, b in zip(ours, theirs, strict=True)]
        max_abs = {n: max(r.max_abs[n] for r in results) for n in self.compared}
        max_rel = {n: max(r.max_rel[n] for r in results) for n in self.compared}
        beyond = {n for r in results for n in r.beyond}
        return StageDiff(stage, max_abs, max_rel, sorted(beyond, key=lambda n: -max_rel[n]))

    def accumulated(self, step: int, theirs: _Pass) -> StageDiff:
        """jaxdp's all-reduced gradient (its own step, the optimizer swapped for a capture)
        against DDP's mean over ranks of ``sum_j w_j grad_j / sum_j w_j``."""
        return self.diff("accumulated gradients", self.jaxdp_gradient(step), self.ddp(step, theirs))

    def ddp(self, step: int, theirs: _Pass) -> dict[str, np.ndarray]:
        """DDP's gradient: each rank sums ``grad(loss_j) / k`` over its micro-batches (``k``
        real ones), the all-reduce averages the ranks: the weighted mean of them all."""
        weights = np.asarray([w for _, _, w in self.micro(step)])
        pairs = list(zip(weights, theirs.grads, strict=True))
        return {n: sum(w * g[n] for w, g in pairs) / weights.sum() for n in self.compared}

    def jaxdp_gradient(self, step: int) -> dict[str, np.ndarray]:
        port, config = self.port, self.port.config
        train_step = make_train_step(
            port.loss_fn,
            _capture(),
            mesh=data_mesh(config.num_devices),
            accum_steps=config.accum_steps,
            path=config.path,
            **port.step_kwargs(),
        )
        state = train_step.init(self.jax_module(self.before(step)))
        batch, weights = self.batches[step - 1]
        if config.path == "fused":
            state, _ = train_step(state, batch, weights)
        else:
            for micro, weight in zip(micro_batches(batch, sizes_of(config)), weights, strict=True):
                state, _ = train_step(state, micro, weight)
        (captured,) = [
            x
            for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, _Captured))
            if isinstance(x, _Captured)
        ]
        flat = self.flat(captured.grads)
        return {name: flat[name] for name in self.compared}

    def flat(self, tree: Any) -> dict[str, np.ndarray]:
        """:func:`flat_arrays` of a tree of jaxdp's step, under the weight map's names."""
        core_name = self.port.weights.framework.core_name
        return {core_name(name): value for name, value in flat_arrays(tree).items()}

    def optimizer(self, step: int) -> StageDiff:
        """Both optimizers replayed from step 1 on torch's gradients at torch's weights (the
        parameter tree jaxdp's step gives optax); the first step whose new weights differ
        (or ``step``'s)."""
        core_name = self.port.weights.framework.core_name
        opt, mask, opt_state, result = self.port.jax_optimizer, None, None, None
        for t in range(1, step + 1):
            state = self.before(t)
            mean = self.ddp(t, self.torch_pass(state, self.micro(t)))
            _, params, _ = split_model(self.jax_module(state))
            if mask is None:
                mask = trainable_mask(params, self.port.step_kwargs().get("trainable"))
                opt_state = opt.init(split_trainable(params, mask))
            trainable = split_trainable(params, mask)
            grads = jax.tree_util.tree_map_with_path(
                lambda p, _, mean=mean: mean[core_name(_dotted(p))], trainable
            )
            updates, opt_state = opt.update(grads, opt_state, trainable)
            new = self.flat(optax.apply_updates(trainable, updates))
            after = self.port.weights.to_jax(self.states[t - 1])
            ours = {n: new[n] for n in self.compared}
            result = self.diff("optimizer update", ours, {n: after[n] for n in self.compared})
            result = dataclasses.replace(result, step=t)
            if result.beyond:
                break
        return result

    # ---- forward, module by module -----------------------------------------------------------

    def trace(self, state: dict[str, np.ndarray], x: np.ndarray) -> str | None:
        import torch

        with torch.no_grad():
            _, theirs = torch_calls(self.torch_model(state), torch.as_tensor(x))
        _, ours = jax_calls(self.jax_module(state), jnp.asarray(x))
        found, self.trace_lines = culprit(theirs, ours, self.rtol, self.atol)
        return found

    def module_params(self, module: str | None) -> list[str]:
        if module is None:
            return []
        prefix = f"{module}." if module else ""
        return [p for p in self.port.weights.params if p.startswith(prefix)]

    def diff(self, stage: str, ours: dict[str, Any], theirs: dict[str, Any]) -> StageDiff:
        max_abs, max_rel, beyond = {}, {}, []
        for name, b in theirs.items():
            a, b = np.asarray(ours[name], np.float64), np.asarray(b, np.float64)
            d = np.abs(a - b)
            max_abs[name] = float(d.max(initial=0.0))
            max_rel[name] = float((d / np.maximum(np.abs(b), np.finfo(np.float64).tiny)).max())
            if np.any(d > self.atol + self.rtol * np.abs(b)):
                beyond.append(name)
        return StageDiff(stage, max_abs, max_rel, sorted(beyond, key=lambda n: -max_rel[n]))

    def finding(self, step, stages, module, theirs: _Pass, ours: _Pass) -> Divergence:
        first = next((s for s in stages if s.beyond), None)
        ratio = float(np.median(np.asarray(ours.losses) / np.asarray(theirs.losses)))
        names = list(first.beyond) if first else []
        if first is not None and first.stage == "forward":
            names = self.module_params(module)
        notes = notes_for(first, module, names, self.trace_lines, ratio, self.port)
        return Divergence(
            step=step,
            stage=first.stage if first else None,
            names=names,
            module=module,
            stages=stages,
            notes=notes,
        )


def _first_bad(theirs: _Pass, ours: _Pass, locator: _Locator) -> int:
    for i, (a, b) in enumerate(zip(ours.outputs, theirs.outputs, strict=True)):
        result = differs(b, a, locator.rtol, locator.atol)
        if result is not None and result[0]:
            return i
    return 0


class _Captured(NamedTuple):
    grads: Any


def _capture() -> optax.GradientTransformation:
    """An "optimizer" that keeps the gradient it gets in its state and updates nothing."""

    def init(params: Any) -> _Captured:
        return _Captured(jax.tree.map(jnp.zeros_like, params))

    def update(updates: Any, state: _Captured, params: Any = None) -> tuple[Any, _Captured]:
        del state, params
        return jax.tree.map(jnp.zeros_like, updates), _Captured(updates)

    return optax.GradientTransformation(init, update)


def flat_arrays(tree: Any) -> dict[str, np.ndarray]:
    """Dotted path -> host array of every leaf (an nnx.Variable's ``value`` left out)."""
    return {
        _dotted(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _dotted(path: tuple) -> str:
    names = _named(path)
    if names and names[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
        names = names[:-1]
    return ".".join(names)


def _torch_dtype(dtype: str) -> Any:
    import torch

    return {"float32": torch.float32, "float64": torch.float64}[dtype]

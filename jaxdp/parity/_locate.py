"""The divergence locator: from torch's weights before one optimizer step, the first
quantity of that step where the port departs from torch, and what departs there.

Quantities, in the order the step computes them: the forward outputs and the loss of every
micro-batch (module by module where the outputs differ), each micro-batch's gradients, the
accumulated and all-reduced gradient (jaxdp's own step on the JAX side, DDP's on the torch
side), then, both optimizers replayed from step 1 on torch's gradients at torch's weights,
the learning rate, the optimizer's moments and the update. torch runs in this process:
DDP's gradient is the sum over every rank's micro-batches of each one's share of the
step's loss (``loss_j / (accum_steps * world_size)``, or ``loss_sum_j / count`` for a
token-weighted loss), computed here micro-batch by micro-batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._forward import split_model
from .._frozen import split_trainable, trainable_mask
from .._layout import micro_batches
from .._mesh import data_mesh
from .._step import make_train_step
from ._locate_text import READING_RTOL, Divergence, StageDiff, notes_for
from ._optim import leaf_name
from ._port import Port
from ._runner import sizes_of, step_batches
from ._trace import culprit, differs, jax_calls, torch_calls

STAGES = (
    "forward",
    "loss",
    "micro-batch gradients",
    "accumulated gradients",
    "learning rate",
    "optimizer moments",
    "optimizer update",
)

# torch's optimizer state per parameter and the optax state field that holds the same.
MOMENTS = {
    "exp_avg": (optax.ScaleByAdamState, "mu"),
    "exp_avg_sq": (optax.ScaleByAdamState, "nu"),
    "momentum_buffer": (optax.TraceState, "trace"),
}


def locate(
    port: Port, torch_states: list[dict[str, np.ndarray]], step: int, rtol: float, atol: float
) -> Divergence:
    """The locator's finding at optimizer ``step`` (1-based) of ``port``'s run, whose torch
    states after every step are ``torch_states`` (torch's layout)."""
    with jax.default_matmul_precision("highest"):
        return _Locator(port, torch_states, rtol, atol).run(step)


class _Pass(NamedTuple):
    outputs: list[np.ndarray]
    losses: list[float]  # each micro-batch's loss as its function returns it (mean or sum)
    counts: list[float] | None  # a weighted loss's count of each micro-batch
    grads: list[dict[str, np.ndarray]]  # of losses[i], per micro-batch, JAX layout
    torch_grads: list[dict[str, np.ndarray]]  # the same in torch's layout (torch's pass)

    def shares(self, weights: np.ndarray) -> np.ndarray:
        """Each micro-batch's factor in the step's loss: ``w_i / sum w`` of the means, or
        ``w_i / sum w_j count_j`` of the sums (the global count)."""
        if self.counts is None:
            return weights / weights.sum()
        return weights / float(np.dot(weights, self.counts))


class _Replayed(NamedTuple):
    """One replayed optimizer step on one side: its rate, moments and new weights."""

    rate: float | None
    moments: dict[str, np.ndarray]  # "path (exp_avg)" -> array, JAX layout
    weights: dict[str, np.ndarray]


class _Locator:
    def __init__(self, port: Port, torch_states: list[dict[str, np.ndarray]], rtol, atol):
        from torch_ref.user import build_user_model, loss_function

        self.port, self.states, self.rtol, self.atol = port, torch_states, rtol, atol
        self.torch_loss = loss_function(port.torch_loss)
        self.build = lambda: build_user_model(
            port.torch_model, seed=port.config.seed, dtype=_torch_dtype(port.config.dtype)
        )
        config = dataclasses.replace(port.config, steps=len(torch_states))
        self.batches = list(step_batches(config, port.data, port.order(), slice(None)))
        self.compared = self._compared()
        self.trace_lines: list[str] = []
        # torch's loss reduction is the comparison's; the port's is its step's (its own
        # step_options may set another: the bug a comparison then finds).
        self.weighted = (
            port.config.loss_reduction == "weighted",
            port.step_kwargs()["loss_reduction"] == "weighted",
        )

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
        weights = self.weights(step)
        stages = [self.forward(theirs, ours), self.loss(theirs, ours, weights)]
        stages.append(self.grads(theirs, ours, weights))
        module = None
        if stages[0].beyond:
            module = self.trace(state, micro[_first_bad(theirs, ours, self)][0])
        if all(s.passed for s in stages):
            stages.append(self.accumulated(step, theirs))
        if all(s.passed for s in stages):
            stages.extend(self.optimizer(step))
        return self.finding(step, stages, module, theirs, ours, weights)

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

    def weights(self, step: int) -> np.ndarray:
        return np.asarray([w for _, _, w in self.micro(step)], np.float64)

    # ---- both sides, micro-batch by micro-batch ----------------------------------------------

    def torch_model(self, state: dict[str, np.ndarray]) -> Any:
        import torch

        model = self.build()
        model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()}, strict=True)
        return model.train()

    def torch_pass(self, state: dict[str, np.ndarray], micro: list) -> _Pass:
        import torch

        model, out = self.torch_model(state), _Pass([], [], [], [], [])
        counts = [] if self.weighted[0] else None
        for x, y, _ in micro:
            model.zero_grad(set_to_none=True)
            output = model(torch.as_tensor(x))
            loss = self.torch_loss(output, torch.as_tensor(y))
            if counts is not None:
                loss, count = loss
                counts.append(float(count))
            loss.backward()
            grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
            out.outputs.append(output.detach().numpy())
            out.losses.append(loss.item())
            out.grads.append(self.to_jax(grads))
            out.torch_grads.append(grads)
        return out._replace(counts=counts)

    def to_jax(self, torch_tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per-parameter torch tensors in the JAX layout (zeros for tensors without one)."""
        full = {k: torch_tensors.get(k, np.zeros_like(v)) for k, v in self.port.initial.items()}
        converted = self.port.weights.to_jax(full)
        return {name: converted[name] for name in self.compared}

    def jax_module(self, state: dict[str, np.ndarray]) -> Any:
        """The port holding torch's ``state``."""
        return self.port.weights.load(
            self.port.jax_module, state, jnp.dtype(self.port.config.dtype)
        )

    def jax_pass(self, state: dict[str, np.ndarray], micro: list) -> _Pass:
        params, forward = self.port.weights.framework.apply(self.jax_module(state))
        weighted = self.weighted[1]

        def objective(params, x, y):
            output = forward(params, x)
            loss = self.port.jax_loss(output, y)
            if weighted:  # (loss_sum, count): the sum is differentiated
                return loss[0], (loss[1], output)
            return loss, (jnp.zeros(()), output)

        grad = jax.jit(jax.value_and_grad(objective, has_aux=True))
        out, counts = _Pass([], [], [], [], []), []
        for x, y, _ in micro:
            (loss, (count, output)), grads = grad(params, x, y)
            flat = flat_arrays(grads)
            out.outputs.append(np.asarray(output))
            out.losses.append(float(loss))
            counts.append(float(count))
            out.grads.append({name: flat[name] for name in self.compared})
        return out._replace(counts=counts if weighted else None)

    # ---- stages ------------------------------------------------------------------------------

    def forward(self, theirs: _Pass, ours: _Pass) -> StageDiff:
        named = {f"output of micro-batch {i}": v for i, v in enumerate(theirs.outputs)}
        mine = {f"output of micro-batch {i}": v for i, v in enumerate(ours.outputs)}
        return self.diff("forward", mine, named)

    def loss(self, theirs: _Pass, ours: _Pass, weights: np.ndarray) -> StageDiff:
        """Each micro-batch's term of the step's loss (its loss times its share, so the
        terms sum to the step's loss), and a weighted loss's counts when both sides count."""
        named, mine = ({} for _ in range(2))
        for side, run in ((named, theirs), (mine, ours)):
            terms = run.shares(weights) * np.asarray(run.losses)
            side.update({f"loss of micro-batch {i}": v for i, v in enumerate(terms)})
        if all(self.weighted):
            named.update({f"count of micro-batch {i}": v for i, v in enumerate(theirs.counts)})
            mine.update({f"count of micro-batch {i}": v for i, v in enumerate(ours.counts)})
        return self.diff("loss", mine, named)

    def grads(self, theirs: _Pass, ours: _Pass, weights: np.ndarray) -> StageDiff:
        """Each micro-batch's gradient of its term of the step's loss: the worst over
        micro-batches, per parameter."""
        shared = [
            [
                {n: s * g[n] for n in self.compared}
                for s, g in zip(run.shares(weights), run.grads, strict=True)
            ]
            for run in (ours, theirs)
        ]
        stage = "micro-batch gradients"
        results = [self.diff(stage, a, b) for a, b in zip(*shared, strict=True)]
        max_abs = {n: max(r.max_abs[n] for r in results) for n in self.compared}
        max_rel = {n: max(r.max_rel[n] for r in results) for n in self.compared}
        beyond = {n for r in results for n in r.beyond}
        return StageDiff(stage, max_abs, max_rel, sorted(beyond, key=lambda n: -max_rel[n]))

    def accumulated(self, step: int, theirs: _Pass) -> StageDiff:
        """jaxdp's all-reduced gradient (its own step, the optimizer swapped for a capture)
        against DDP's: the sum of every micro-batch's share of the gradient."""
        mean = self.ddp(step, theirs, theirs.grads)
        return self.diff("accumulated gradients", self.jaxdp_gradient(step), mean)

    def ddp(self, step: int, theirs: _Pass, grads: list[dict]) -> dict[str, np.ndarray]:
        """DDP's gradient from torch's micro-batch ``grads`` (either layout): each rank sums
        ``grad(loss_j) / k`` (``grad(loss_sum_j) * W / count``), the all-reduce averages
        the ranks; a tensor no micro-batch gave a gradient stays out."""
        pairs = list(zip(theirs.shares(self.weights(step)), grads, strict=True))
        names = dict.fromkeys(n for g in grads for n in g)
        return {n: sum(s * g[n] for s, g in pairs if n in g) for n in names}

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

    def optimizer(self, step: int) -> list[StageDiff]:
        """Both optimizers replayed from step 1 on torch's gradients at torch's weights (the
        parameter tree jaxdp's step gives optax), compared at each replayed step in the
        order they compute: the learning rate, the moments after the step, the new weights;
        the first step where one differs (or ``step``'s)."""
        torch_side, jax_side = _TorchReplay(self), _JaxReplay(self)
        for t in range(1, step + 1):
            state = self.before(t)
            theirs = self.torch_pass(state, self.micro(t))
            ours = jax_side.step(t, state, self.ddp(t, theirs, theirs.grads))
            replayed = torch_side.step(state, self.ddp(t, theirs, theirs.torch_grads))
            after = self.port.weights.to_jax(self.states[t - 1])
            stages = []
            if ours.rate is not None:
                rate = self.diff("learning rate", {"lr": ours.rate}, {"lr": replayed.rate})
                stages.append(rate)
            both = sorted(ours.moments.keys() & replayed.moments.keys())
            if both:
                mine = {n: ours.moments[n] for n in both}
                theirs_moments = {n: replayed.moments[n] for n in both}
                stages.append(self.diff("optimizer moments", mine, theirs_moments))
            new = {n: ours.weights[n] for n in self.compared}
            stages.append(self.diff("optimizer update", new, {n: after[n] for n in self.compared}))
            stages = [dataclasses.replace(s, step=t) for s in stages]
            self.replayed = (t, state, ours, replayed.rate, after)
            if any(s.beyond for s in stages):
                break
        return stages

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

    def finding(self, step, stages, module, theirs: _Pass, ours: _Pass, weights) -> Divergence:
        first = next((s for s in stages if s.beyond), None)
        terms = [run.shares(weights) * np.asarray(run.losses) for run in (ours, theirs)]
        ratio = float(np.median(terms[0] / terms[1]))
        names = list(first.beyond) if first else []
        detail: list[str] = []
        update_kind = "optimizer formula"
        if first is not None and first.stage == "forward":
            names = self.module_params(module)
        elif first is not None and first.stage == "loss":
            detail = self.loss_reading(first, theirs, ours, weights)
        elif first is not None and first.stage == "optimizer moments":
            names = list(dict.fromkeys(n.rpartition(" (")[0] for n in first.beyond))
        elif first is not None and first.stage == "optimizer update":
            update_kind, detail = self.update_reading(first, stages)
        rate_read = any(s.stage == "learning rate" for s in stages)
        kind, notes = notes_for(
            first, module, names, self.trace_lines, ratio, self.port, detail, update_kind, rate_read
        )
        return Divergence(
            step=step,
            stage=first.stage if first else None,
            names=names,
            module=module,
            stages=stages,
            notes=notes,
            kind=kind,
        )

    def loss_reading(self, first: StageDiff, theirs: _Pass, ours: _Pass, weights) -> list[str]:
        """What a loss that differs from the first micro-batch on says about its
        normalization: counts that differ, or a window averaged per micro-batch."""
        counted = [n for n in first.beyond if n.startswith("count of")]
        if counted:
            i = int(counted[0].rpartition(" ")[2])
            return [
                f"the counts differ (micro-batch {i}: jaxdp {ours.counts[i]:g}, torch "
                f"{theirs.counts[i]:g}): the port's loss counts other items than torch's "
                "(padding, a mask, the label shift)"
            ]
        if self.weighted == (True, False):
            means = np.asarray(theirs.losses) / np.asarray(theirs.counts)
            if self._close(weights / weights.sum() * means, ours.shares(weights) * ours.losses):
                return [
                    "jaxdp's terms are each micro-batch's mean over the number of "
                    "micro-batches: the port averages per micro-batch (every micro-batch "
                    "weighs the same), torch weighs every item the same (its window's "
                    "token count); return (loss_sum, count) with loss_reduction='weighted'"
                ]
        if self.weighted != (False, False):
            return [
                f"torch's loss is {_reduction(self.weighted[0])}, the port's step "
                f"{_reduction(self.weighted[1])}"
            ]
        return []

    def update_reading(self, first: StageDiff, stages: list[StageDiff]) -> tuple[str, list[str]]:
        """What an update that differs with the gradients and moments agreeing says, as
        ``(kind, lines)``: every leaf's by one factor (the rate, or a gradient scaled
        otherwise), one group of leaves (decay or a mask), or every leaf (the formula)."""
        t, state, ours, rate, after = self.replayed
        old = self.to_jax(state)
        ours_d = np.concatenate([(ours.weights[n] - old[n]).ravel() for n in self.compared])
        torch_d = np.concatenate([(after[n] - old[n]).ravel() for n in self.compared])
        factor = float(np.dot(ours_d, torch_d) / max(np.dot(torch_d, torch_d), 1e-300))
        rate_agrees = any(s.stage == "learning rate" for s in stages)
        if abs(factor - 1) > 100 * READING_RTOL and self._close(factor * torch_d, ours_d):
            if rate_agrees:
                return "optimizer formula", [
                    f"every leaf's update is torch's times {factor:.6g} with the learning "
                    "rate agreeing: the gradient is scaled otherwise before the update (the "
                    "clip: torch's clip_grad_norm_ divides by norm + 1e-6)"
                ]
            return "schedule", [
                f"every leaf's update is torch's times {factor:.6g}: a learning rate "
                f"{factor:.6g} times torch's {rate:g} (a schedule a step off, another base "
                "rate), or a gradient scaled otherwise (the clip)"
            ]
        if len(first.beyond) == len(self.compared):
            return "optimizer formula", []
        group = sorted(first.beyond)
        ends = sorted({n.rpartition(".")[2] for n in group})
        alike = sorted(n for n in self.compared if n.rpartition(".")[2] in ends)
        which = f"every leaf named {', '.join(ends)}" if alike == group else "these leaves"
        lines = [
            f"the update differs for {which} ({len(group)} of {len(self.compared)} leaves: "
            f"{', '.join(group)}); every other leaf agrees"
        ]
        if rate is not None:
            lines.extend(self.decay_reading(group, rate, old, ours.weights, after))
        return "weight decay or mask", lines

    def decay_reading(self, group, rate, old, ours, after) -> list[str]:
        """Whether ``jaxdp - torch`` on ``group`` is ``-lr * e * p`` for one ``e`` (each
        leaf's rate and torch's decay from its parameter group): the port decays these
        leaves by torch's decay ``+ e``, and which way that reads."""
        spec = self.port.spec
        settings = {}
        for n in group:
            torch_name = self.port.weights.torch_name(n)
            g = 0 if torch_name is None else spec.group_of(torch_name)
            lr, decay = spec.settings(g)
            settings[n] = (rate * lr / spec.learning_rate if spec.learning_rate else rate, decay)
        scaled = np.concatenate([settings[n][0] * old[n].ravel() for n in group])
        off = np.concatenate([(ours[n] - after[n]).ravel() for n in group])
        norm = float(np.dot(scaled, scaled))
        extra = -float(np.dot(off, scaled)) / norm if norm else 0.0
        if not (extra and self._close(-extra * scaled, off)):
            return []
        decays = sorted({decay for _, decay in settings.values()})
        where = "exactly these leaves"
        if len(decays) == 1 and self._close(decays[0] + extra, 0.0):
            return [
                f"jaxdp - torch = +lr * weight_decay * p on {where}: the port does not decay "
                "them; torch does"
            ]
        if len(decays) == 1 and self._close(extra, decays[0]):
            return [
                f"jaxdp - torch = -lr * weight_decay * p on {where}: the port decays them twice"
            ]
        torch_side = ", ".join(f"{d:g}" for d in decays)
        return [
            f"jaxdp - torch = -lr * {extra:.6g} * p on {where}: the port decays them by "
            f"weight_decay {', '.join(f'{d + extra:.6g}' for d in decays)}, torch's parameter "
            f"group by {torch_side}"
        ]

    def _close(self, a: Any, b: Any) -> bool:
        """``a`` equals ``b`` to :data:`READING_RTOL` (and float64's floor)."""
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return bool(np.all(np.abs(a - b) <= self.atol + READING_RTOL * np.abs(b)))


class _TorchReplay:
    """torch's optimizer (and scheduler) in this process, stepped on given gradients at
    torch's recorded weights: the rate of each step and the moments after it."""

    def __init__(self, locator: _Locator):
        import torch_ref
        from torch_ref.user import scheduler_factory

        self.locator = locator
        port = locator.port
        self.model = locator.torch_model(port.initial)
        self.params = dict(self.model.named_parameters())
        config = torch_ref.OptimConfig(**dataclasses.asdict(port.spec))
        self.optimizer = torch_ref.build_optimizer(self.model.named_parameters(), config)
        self.scheduler = None
        if port.torch_scheduler is not None:
            self.scheduler = scheduler_factory(port.torch_scheduler)(self.optimizer)

    def step(self, state: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> _Replayed:
        import torch

        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(torch.as_tensor(state[name]))
                p.grad = torch.as_tensor(grads[name]).clone() if name in grads else None
        spec = self.locator.port.spec
        if spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), spec.max_grad_norm)
        rate = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        moments = {}
        for key in MOMENTS:
            held = {
                n: p
                for n, p in self.params.items()
                if isinstance(self.optimizer.state.get(p, {}).get(key), torch.Tensor)
            }
            if held:
                tensors = {n: self.optimizer.state[p][key].numpy() for n, p in held.items()}
                converted = self.locator.to_jax(tensors)
                moments.update({f"{n} ({key})": converted[n] for n in converted})
        return _Replayed(rate, moments, {})


class _JaxReplay:
    """The port's optax optimizer stepped on given gradients at torch's weights, its state
    carried from step to step: the rate it used (when it can be read), its moments, its
    new weights."""

    def __init__(self, locator: _Locator):
        self.locator = locator
        self.mask = self.state = None

    def step(self, t: int, state: dict[str, np.ndarray], mean: dict[str, np.ndarray]) -> _Replayed:
        locator = self.locator
        core_name = locator.port.weights.framework.core_name
        opt = locator.port.jax_optimizer
        _, params, _ = split_model(locator.jax_module(state))
        if self.mask is None:
            self.mask = trainable_mask(params, locator.port.step_kwargs().get("trainable"))
            self.state = opt.init(split_trainable(params, self.mask))
        trainable = split_trainable(params, self.mask)
        grads = jax.tree_util.tree_map_with_path(
            lambda p, _: mean[core_name(leaf_name(p))], trainable
        )
        updates, self.state = opt.update(grads, self.state, trainable)
        new = locator.flat(optax.apply_updates(trainable, updates))
        return _Replayed(self.rate(t), self.moments(), new)

    def rate(self, t: int) -> float | None:
        """The learning rate of update ``t``: the port's own (compare_models built its
        optimizer with it), or an ``optax.inject_hyperparams`` state's; None if unknown."""
        rate = self.locator.port.learning_rate
        if callable(rate):
            return float(rate(jnp.asarray(t - 1, jnp.int32)))  # optax's count: int32
        if rate is not None:
            return float(rate)
        for leaf in jax.tree.leaves(self.state, is_leaf=_is_hyperparams):
            if _is_hyperparams(leaf) and "learning_rate" in leaf.hyperparams:
                return float(leaf.hyperparams["learning_rate"])
        return None

    def moments(self) -> dict[str, np.ndarray]:
        """torch's names for the moments the optax state holds (each leaf's from the first
        Adam or trace state that holds it: ``multi_transform`` keeps one per parameter
        group, the other groups' leaves masked), keyed as :class:`_TorchReplay`'s."""
        out: dict[str, np.ndarray] = {}
        for key, (kind, field) in MOMENTS.items():
            found = [
                s
                for s in jax.tree.leaves(self.state, is_leaf=lambda x, k=kind: isinstance(x, k))
                if isinstance(s, kind)
            ]
            for state in found:
                flat = self.locator.flat(getattr(state, field))
                for n in self.locator.compared:
                    if n in flat:
                        out.setdefault(f"{n} ({key})", flat[n])
        return out


def _is_hyperparams(x: Any) -> bool:
    # optax.inject_hyperparams builds the stateful kind (optax 0.2.8).
    kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
    return isinstance(x, kinds)


def _reduction(weighted: bool) -> str:
    return "token-weighted (loss_sum / count)" if weighted else "a mean of micro-batch means"


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
        leaf_name(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _torch_dtype(dtype: str) -> Any:
    import torch

    return {"float32": torch.float32, "float64": torch.float64}[dtype]

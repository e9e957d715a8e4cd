"""Issue 44's trial again: every case its report names as not OK, run as a user would.

Run from the repository root (about 6 minutes on 2 cores)::

    .venv/bin/python benchmarks/studies/fault_trial_44.py
    .venv/bin/python benchmarks/studies/fault_trial_44.py --only plan parity-usage

Each case is the command (or library call) of the issue, and a verdict: ``OK`` (ended
as it must: a plan or a refusal, one ``jaxdp ...: error:`` line and status 2, Ctrl-C's
one line per process and status 130, the signalled rank named), ``unclear`` (ended, but
said something else), ``crash`` (a traceback, or a death nobody asked for) or ``hang``
(not ended within the case's bound). Commands run in sessions of their own with SIGINT
at its default disposition, as a terminal runs them; ``--load N`` adds N busy loops at
this process's priority while the launcher's hang-timeout cases run (run it under ``nice``
on a shared machine). Prints a table and the counts.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

# python -m jaxdp with SIGINT at its default disposition, whatever this process inherited.
JAXDP = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, '-m', 'jaxdp', *sys.argv[1:]])",
]
STACK = ["parity", "--model", "stack", "--zero-stage", "3", "--shards", "2", "--num-devices", "4"]
LAUNCH = ["launch", "--nprocs", "2", "--devices-per-process", "2"]
Row = tuple[str, str, str]  # case, verdict, what it said


class Run:
    """A command in a session of its own, its output gathered line by line."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen(
            [*JAXDP, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.started = time.monotonic()

    def read_until(self, pattern: str, timeout: float = 300) -> bool:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        os.set_blocking(self.proc.stdout.fileno(), False)
        while time.monotonic() < deadline and self.proc.poll() is None:
            line = self.proc.stdout.readline()
            if not line:
                time.sleep(0.02)
                continue
            self.lines.append(line.rstrip("\n"))
            if re.search(pattern, line):
                return True
        return False

    def signal(self, signum: int, pid: int | None = None) -> None:
        os.kill(pid or self.proc.pid, signum)

    def finish(self, timeout: float) -> tuple[int | None, float]:
        """Waits; the exit status as a shell says it (None: a hang, then killed)."""
        sent = time.monotonic()
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, _ = self.proc.communicate()
            self.lines += out.splitlines()
            return None, time.monotonic() - sent
        self.lines += out.splitlines()
        code = self.proc.returncode
        return (128 - code if code < 0 else code), time.monotonic() - sent


def verdict(status: int | None, lines: list[str], want: int, said: Callable[[list], bool]) -> str:
    if status is None:
        return "hang"
    if any("Traceback" in x or "Fatal Python" in x for x in lines) or status in (134, 139):
        return "crash"
    return "OK" if status == want and said(lines) else "unclear"


def usage(name: str, args: list[str]) -> Row:
    run = Run(args)
    status, took = run.finish(120)

    def one_line(lines: list[str]) -> bool:
        return len(lines) == 1 and re.match(r"jaxdp \w+: error: ", lines[0]) is not None

    return name, verdict(status, run.lines, 2, one_line), (run.lines or ["(nothing)"])[-1][:110]


def plan_cases() -> list[Row]:
    from jaxdp.plan import plan_memory

    rows = []
    for g in (10**18, 10**30):
        began = time.monotonic()
        try:
            plan = plan_memory(
                params=7e9,
                global_batch_size=g,
                device_memory="80GB",
                zero_stage=3,
                activation_bytes_per_sample=1e9,
            )
            said = f"a plan: fits={plan.fits_state}, micro_batch_size={plan.micro_batch_size}"
        except ValueError as e:
            said = f"refused: {str(e)[:80]}"
        took = time.monotonic() - began
        rows.append(
            (
                f"plan --global-batch-size 1e{len(str(g)) - 1} (stage 3, 1GB/sample)",
                "OK" if took < 1 else "hang",
                f"{took * 1e3:.0f} ms; {said}",
            )
        )
    base = ["plan", "--params", "7e9", "--device-memory", "80GB"]
    for name, extra in [
        ("plan --zero-stage 3 --layers 0", ["--zero-stage", "3", "--layers", "0"]),
        ("plan --root-params 2e9 --params 1e9", ["--root-params", "2e9", "--params", "1e9"]),
        ("plan --num-devices 0", ["--num-devices", "0"]),
        ("plan: global batch 30 on 4 devices", ["--num-devices", "4", "--global-batch-size", "30"]),
    ]:
        rows.append(usage(name, base + extra))
    model = ["plan", "--model", "cnn", "--device-memory", "1GB", "--model-arg"]
    rows.append(usage("plan --model-arg width=3", model + ["width=3"]))
    rows.append(usage("plan --model-arg channels=-1", model + ["channels=-1"]))
    return rows


def parity_usage_cases() -> list[Row]:
    return [
        usage("parity --zero-stage 3 --strategy pmap", [*STACK[:5], "--strategy", "pmap"]),
        usage("parity --zero-stage 3 --shards 1", [*STACK[:5], "--shards", "1"]),
        usage("parity --torch-device cuda (no GPU)", ["parity", "--torch-device", "cuda"]),
    ]


def ctrl_c(name: str, args: list[str], wait: Callable[[Run], None], want_lines: int) -> Row:
    run = Run(args)
    wait(run)
    run.signal(signal.SIGINT)
    status, took = run.finish(60)
    interrupted = [x for x in run.lines if "interrupted (SIGINT)" in x]

    def ok(lines: list[str]) -> bool:
        return len(interrupted) == want_lines and took < 10

    said = f"{took:.1f} s after; {len(run.lines)} line(s), {len(interrupted)} 'interrupted'"
    return name, verdict(status, run.lines, 130, ok), said


def parity_ctrl_c_cases() -> list[Row]:
    rows = [
        ctrl_c(
            f"parity (stack, stage 3 HSDP): SIGINT {t} s in",
            STACK,
            lambda run, t=t: time.sleep(t),
            1,
        )
        for t in (1.5, 2.0, 2.5, 3.0)
    ]
    linear = ["parity", "--model", "linear", "--num-devices", "2", "--steps", "1"]

    def ranks_training(run: Run) -> None:
        while len(_children(run.proc.pid)) < 2 and run.proc.poll() is None:
            time.sleep(0.05)
        time.sleep(2)

    rows.append(ctrl_c("parity mid-run (DDP ranks): SIGINT", linear, ranks_training, 1))
    return rows


def train_ctrl_c_cases(tmp: pathlib.Path) -> list[Row]:
    stage3 = ["train", "--zero-stage", "3", "--no-progress", "--steps", "4"]
    rows = [
        ctrl_c("train --zero-stage 3: SIGINT 1 s in", stage3, lambda run: time.sleep(1), 1),
        ctrl_c(
            "train --zero-stage 3: SIGINT while compiling",
            stage3,
            lambda run: run.read_until("^zero_stage=3:"),
            1,
        ),
    ]
    ckpt = ["--checkpoint-dir", str(tmp / "resume")]
    subprocess.run([*JAXDP, *stage3[:-1], "1", *ckpt], capture_output=True)
    rows.append(
        ctrl_c(
            "train --resume: SIGINT while restoring",
            ["train", "--resume", *ckpt],
            lambda run: run.read_until("taken from checkpoint"),
            1,
        )
    )
    launch = [*LAUNCH, "--", "train", "--no-progress", "--steps", "20"]
    rows.append(ctrl_c("launch -- train: SIGINT 0.5 s in", launch, lambda r: time.sleep(0.5), 2))
    rows.append(
        ctrl_c(
            "launch -- train: SIGINT while compiling",
            launch,
            lambda run: run.read_until(r"processes: 2"),
            2,
        )
    )
    return rows


def save_ctrl_c_cases(tmp: pathlib.Path) -> list[Row]:
    """Two Ctrl-Cs 0.2 s apart during a stage-3 save, then a resume from what is there."""
    rows = []
    for i, gap in enumerate((0.0, 0.1, 0.2, 0.3)):
        folder = tmp / f"save{i}"
        args = [
            "train",
            "--zero-stage",
            "3",
            "--no-progress",
            "--steps",
            "50",
            "--checkpoint-every",
            "1",
            "--checkpoint-dir",
            str(folder),
        ]
        run = Run(args)
        run.read_until(r"^checkpoint .*/3: ")
        run.signal(signal.SIGINT)  # stops after this micro-batch and saves there
        time.sleep(0.2 + gap)
        run.signal(signal.SIGINT)
        status, took = run.finish(60)
        corrupt = any("read back intact" in x for x in run.lines)
        resumed = subprocess.run(
            [
                *JAXDP,
                "train",
                "--resume",
                "--checkpoint-dir",
                str(folder),
                "--steps",
                "5",
                "--no-progress",
            ],
            capture_output=True,
            text=True,
        )

        def ok(lines: list[str], corrupt: bool = corrupt, resumed: object = resumed) -> bool:
            return not corrupt and resumed.returncode == 0

        said = f"{status}; 'intact' message: {corrupt}; resume: {resumed.returncode}"
        rows.append(
            (
                f"train stage 3: 2 Ctrl-Cs {0.2 + gap:.1f} s apart in a save",
                verdict(status, run.lines, status or 0, ok),
                said,
            )
        )
    return rows


def launcher_cases(tmp: pathlib.Path, load: int) -> list[Row]:
    rows = []
    hsdp = [
        "train",
        "--zero-stage",
        "3",
        "--shards",
        "2",
        "--hidden",
        "8",
        "--no-progress",
        "--steps",
        "8",
        "--checkpoint-every",
        "1",
    ]
    for signum, restarts, want in ((signal.SIGTERM, 1, 0), (signal.SIGINT, 0, 130)):
        name = signal.Signals(signum).name
        args = [
            *LAUNCH,
            "--max-restarts",
            str(restarts),
            "--",
            *hsdp,
            "--checkpoint-dir",
            str(tmp / f"hsdp-{name}"),
        ]
        run = Run(args)
        run.read_until(r"checkpoint .*/2: ")
        ranks = _children(run.proc.pid)
        run.signal(signum, ranks.get(1))
        status, took = run.finish(300)
        named = [x for x in run.lines if x.startswith("jaxdp launch:") and "rank" in x]

        def ok(lines: list[str], named: list[str] = named, name: str = name) -> bool:
            return bool(named) and all(re.search(rf"rank 1 .*\({name}\)", x) for x in named)

        rows.append(
            (
                f"launch HSDP: {name} to rank 1 in a save (--max-restarts {restarts})",
                verdict(status, run.lines, want, ok),
                (named or ["(no verdict)"])[0][:110],
            )
        )
    # At this process's own priority: they compete with the launch as the trial's load did.
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    try:
        for i in range(4):
            args = [
                *LAUNCH,
                "--hang-timeout-s",
                "2",
                "--",
                "train",
                "--no-progress",
                "--steps",
                "6",
            ]
            run = Run(args)
            status, took = run.finish(300)
            rows.append(
                (
                    f"launch --hang-timeout-s 2, a finished run (load +{load}), {i + 1}",
                    verdict(status, run.lines, 0, lambda lines: True),
                    f"status {status}; load {os.getloadavg()[0]:.1f}",
                )
            )
    finally:
        for p in busy:
            p.kill()
    return rows


def message_cases() -> list[Row]:
    """Item 7's messages, in this process (4 CPU devices)."""
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import jaxdp

    def raises(name: str, call: Callable[[], object], words: list[str]) -> Row:
        try:
            call()
        except ValueError as e:
            ok = all(w in str(e) for w in words)
            return name, "OK" if ok else "unclear", str(e).split("\n")[0][:110]
        except Exception as e:
            return name, "crash", f"{type(e).__name__}: {str(e)[:90]}"
        return name, "unclear", "accepted"

    def loss(p, batch):
        x, y = batch
        return jnp.mean((x @ p["w"] - y) ** 2)

    def step(path="multisteps", **parallel):
        return jaxdp.make_train_step(
            loss,
            optax.sgd(0.1),
            mesh=jaxdp.data_mesh(4),
            accum_steps=2,
            path=path,
            parallel=jaxdp.Parallel(**parallel),
        )

    params, micro = {"w": np.ones((8, 4))}, (np.ones((4, 8)), np.ones((4, 4)))
    h = jnp.zeros((2, 16))
    sequential = nnx.Sequential(*[nnx.Linear(16, 16, rngs=nnx.Rngs(i)) for i in range(3)])
    return [
        raises(
            "Parallel(zero_stage=3, gather_dtype='float8_e4m3fn')",
            lambda: jaxdp.Parallel(zero_stage=3, gather_dtype="float8_e4m3fn"),
            ["gather_dtype", "bfloat16"],
        ),
        raises(
            "scan_layers(nnx.Linear(16, 16))",
            lambda: jaxdp.scan_layers(
                lambda layer, c: layer(c), nnx.Linear(16, 16, rngs=nnx.Rngs(0)), h
            ),
            ["stack of layers", "nnx.vmap", "nnx.Linear"],
        ),
        raises(
            "scan_layers(nnx.Sequential of 3 Linear)",
            lambda: jaxdp.scan_layers(lambda layer, c: layer(c), sequential, h),
            ["stack of layers", "nnx.vmap", "nnx.Sequential"],
        ),
        raises(
            "HSDP multisteps state -> stage-3 multisteps step",
            lambda: step(zero_stage=3)(step(zero_stage=3, shards=2).init(params), micro),
            ["HSDP", "zero_stage=3"],
        ),
        raises(
            "stage-3 multisteps state -> stage-0 multisteps step",
            lambda: step(zero_stage=0)(step(zero_stage=3).init(params), micro),
            ["split over the devices", "per device"],
        ),
    ]


def _children(pid: int) -> dict[int, int]:
    """``{JAXDP_PROCESS_ID or index: pid}`` of ``pid``'s children (Linux /proc)."""
    found: dict[int, int] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != pid or fields[0] == "Z":
                continue
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next(
            (int(x.split(b"=")[1]) for x in env if x.startswith(b"JAXDP_PROCESS_ID=")),
            len(found) + 100,
        )
        found[rank] = int(stat.parent.name)
    return found


GROUPS = {
    "plan": lambda tmp, load: plan_cases(),
    "parity-usage": lambda tmp, load: parity_usage_cases(),
    "parity-ctrl-c": lambda tmp, load: parity_ctrl_c_cases(),
    "train-ctrl-c": lambda tmp, load: train_ctrl_c_cases(tmp),
    "save-ctrl-c": lambda tmp, load: save_ctrl_c_cases(tmp),
    "launcher": launcher_cases,
    "messages": lambda tmp, load: message_cases(),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(GROUPS), default=sorted(GROUPS))
    parser.add_argument("--load", type=int, default=16, help="busy loops for the hang cases")
    args = parser.parse_args()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="fault-trial-44-") as tmp:
        for group in sorted(args.only, key=list(GROUPS).index):
            rows += GROUPS[group](pathlib.Path(tmp), args.load)
    width = max(len(case) for case, _, _ in rows)
    print(f"| {'case':<{width}} | verdict | what it said |")
    print(f"|{'-' * (width + 2)}|---------|---|")
    for case, result, said in rows:
        print(f"| {case:<{width}} | {result:<7} | {said.replace('|', '/')} |")
    counts = {v: sum(r[1] == v for r in rows) for v in ("OK", "unclear", "crash", "hang")}
    print(", ".join(f"{n} {v}" for v, n in counts.items()), f"of {len(rows)}")


if __name__ == "__main__":
    main()

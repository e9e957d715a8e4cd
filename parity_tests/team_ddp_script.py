"""A team's own PyTorch training script, as a team writes it: DDP on gloo, gradient
accumulation with ``no_sync`` on the first ``ACCUM_STEPS - 1`` micro-batches, AdamW with
two parameter groups (no weight decay and twice the rate on biases and the norm), a
warm-up ``LambdaLR``, ``clip_grad_norm_``, float64, its own ``DistributedSampler`` loop.
Three lines record it for jaxdp's comparison with its JAX port (``torch_ref.Recorder``).

    torchrun --standalone --nproc-per-node 2 parity_tests/team_ddp_script.py
    # or: jaxdp parity --torch-script parity_tests/team_ddp_script.py --num-devices 2 ...

Writes the record to ``$TORCH_REF_RECORD``. Importing it builds nothing: the comparison
imports ``Net`` from here.
"""

from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torch_ref

ACCUM_STEPS = 2  # micro-batches per optimizer step on each rank
MICRO_BATCH_SIZE = 4  # rows per forward/backward
STEPS = 4  # optimizer steps (two epochs of the 48 rows on 2 ranks)
LR, WEIGHT_DECAY, WARMUP, MAX_GRAD_NORM = 1e-2, 0.1, 3, 1.0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(48, 6)), rng.integers(0, 3, size=48)


def param_groups(model):
    """Decay on the Linear weights only; biases and the norm at twice the rate, no decay."""
    decay = [p for n, p in model.named_parameters() if n.startswith("fc") and n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if all(p is not q for q in decay)]
    return [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": rest, "weight_decay": 0.0, "lr": 2 * LR},
    ]


def warmup(step):
    return min(1.0, (step + 1) / WARMUP)


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(Net().double())
    optimizer = torch.optim.AdamW(param_groups(model.module), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    x, y = data()
    dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    sampler = DistributedSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=MICRO_BATCH_SIZE, sampler=sampler, drop_last=True)
    recorder = torch_ref.Recorder(model, optimizer, max_grad_norm=MAX_GRAD_NORM)  # record 1/3

    step, epoch = 0, 0
    while step < STEPS:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(len(loader) // ACCUM_STEPS):
            total = 0.0
            for micro_step in range(ACCUM_STEPS):
                xb, yb = next(batches)
                # Only the last micro-batch all-reduces: no_sync covers forward and backward.
                last = micro_step == ACCUM_STEPS - 1
                with nullcontext() if last else model.no_sync():
                    loss = F.cross_entropy(model(xb), yb) / ACCUM_STEPS
                    loss.backward()
                recorder.micro_batch(xb, yb)  # record 2/3
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            recorder.step(total)  # record 3/3: after optimizer.step(), on every rank
            step += 1
            if step == STEPS:
                break
        epoch += 1
    recorder.save()  # rank 0 writes $TORCH_REF_RECORD
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

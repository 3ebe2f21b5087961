"""Denoise random signals with a small DDP model, seeding nothing.

Written the way many quick experiments are: the data are drawn fresh with
``torch.randn`` on every rank (a synthetic task, so each process makes its own
shard), the model has dropout, and no seed is set anywhere.  Under

    torchrun --nproc-per-node 2 unseeded_train.py

every process starts with its own random generators, so each rank trains on
its own noise and drops its own units.  Each rank prints its first batch's
checksum and its local losses.
"""

import argparse

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    clean = torch.randn(64, 8)
    noisy = clean + 0.3 * torch.randn(64, 8)
    jitter = float(np.random.rand())  # e.g. a random augmentation strength
    print(f"rank {rank} checksum {clean.sum().item():.6f} jitter {jitter:.6f}")
    for step in range(args.steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(noisy), clean)
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Train a small regression MLP with DistributedDataParallel.

Written the way torchrun scripts usually are (argparse, ``init_process_group``
from the environment torchrun sets, a ``DistributedSampler``, a checkpoint
from rank 0, ``destroy_process_group`` at the end), so it runs unchanged with

    torchrun --nproc-per-node 2 ddp_train.py --epochs 2

and, in a notebook, with ``%dp run ddp_train.py --epochs 2``.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args():
    parser = argparse.ArgumentParser(description="DDP regression example")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--checkpoint", type=str, default="")
    return parser.parse_args()


def make_data(n):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    return TensorDataset(x, x @ w + 0.01 * torch.randn(n, 1, generator=g))


def main():
    args = parse_args()
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = dist.get_world_size()
    if rank == 0:
        print(f"world size {world_size}, local rank {local_rank}")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    dataset = make_data(args.samples)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total, count = torch.zeros(1), torch.zeros(1)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp_model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(x)
            count += len(x)
        dist.all_reduce(total)
        dist.all_reduce(count)
        if rank == 0:
            print(f"epoch {epoch} loss {(total / count).item():.6f}")

    if args.checkpoint and rank == 0:
        torch.save({"model": ddp_model.module.state_dict(), "epochs": args.epochs}, args.checkpoint)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

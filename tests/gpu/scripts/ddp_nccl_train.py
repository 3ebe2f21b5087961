"""Train a small regression MLP with DDP on GPUs, as torchrun GPU scripts are written.

The habits of PyTorch's own DDP tutorial and most training repositories:
``init_process_group("nccl")``, ``torch.cuda.set_device(LOCAL_RANK)``, the
model moved with ``.to(local_rank)`` (an int), ``DDP(model, device_ids=[local_rank])``,
each batch moved to the GPU inside the loop, ``destroy_process_group`` at the end:

    torchrun --nproc-per-node 1 ddp_nccl_train.py --epochs 2

and, in a notebook on a cluster of GPU engines, ``%dp run ddp_nccl_train.py --epochs 2``.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args():
    parser = argparse.ArgumentParser(description="DDP on GPUs")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--checkpoint", type=str, default="")
    return parser.parse_args()


def setup() -> int:
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return local_rank


def main():
    args = parse_args()
    local_rank = setup()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"world size {world_size}, local rank {local_rank}, "
              f"device {torch.cuda.current_device()}")
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 16, generator=g)
    dataset = TensorDataset(x, x @ torch.randn(16, 1, generator=g))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(local_rank)
    ddp_model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-2)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=local_rank)
        for xb, yb in loader:
            xb, yb = xb.to(local_rank), yb.to(local_rank)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp_model(xb), yb)
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * len(xb), torch.tensor(float(len(xb)),
                                                                        device=local_rank)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch} loss {(total[0] / total[1]).item():.6f}")
    if args.checkpoint and rank == 0:
        torch.save(ddp_model.module.state_dict(), args.checkpoint)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

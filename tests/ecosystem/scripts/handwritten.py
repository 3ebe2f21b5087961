"""Data parallelism by hand, as course notebooks write it: the gradient all-reduce of
DDP (one ``all_reduce`` per parameter) and a ZeRO-2 step (gradients flattened,
``reduce_scatter`` so each rank keeps the sum of its shard, a local SGD step on
that shard, ``all_gather`` of the updated parameters) -- and, for comparison,
torch's own ``DistributedDataParallel`` with the user's own loop (``--mode
torchddp``).

    torchrun --nproc-per-node 2 handwritten.py --mode zero --steps 20

The same text runs pasted into a ``%%dp`` cell (argparse then sees no
arguments).  It prints the last loss, a checksum of the parameters, and the
time of the timed steps.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def build(width):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 1))


def ddp_step(model, x, y, lr):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    world = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None
    return loss


def zero_step(model, x, y, lr):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    world, rank = dist.get_world_size(), dist.get_rank()
    params = list(model.parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    pad = (-flat.numel()) % world
    flat = torch.cat([flat, flat.new_zeros(pad)])
    shard = flat.new_empty(flat.numel() // world)
    dist.reduce_scatter_single(shard, flat)  # my shard of the summed gradient
    shard /= world
    with torch.no_grad():
        full = torch.cat([p.reshape(-1) for p in params] + [flat.new_zeros(pad)])
        mine = full[rank * shard.numel():(rank + 1) * shard.numel()] - lr * shard
        dist.all_gather_single(full, mine)  # everyone's updated shard
        offset = 0
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
            p.grad = None
    return loss


def torchddp_step(model, x, y, lr):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None
    return loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ddp", "zero", "torchddp"), default="zero")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = build(args.width)
    if args.mode == "torchddp":
        model = nn.parallel.DistributedDataParallel(model)
    step = {"ddp": ddp_step, "zero": zero_step, "torchddp": torchddp_step}[args.mode]
    gen = torch.Generator().manual_seed(rank)
    batches = [(x, x.sum(-1, keepdim=True).tanh()) for x in
               (torch.randn(args.batch, 64, generator=gen) for _ in range(args.warmup + args.steps))]
    for x, y in batches[:args.warmup]:
        step(model, x, y, 0.01)
    dist.barrier()
    t0 = time.perf_counter()
    for x, y in batches[args.warmup:]:
        loss = step(model, x, y, 0.01)
    elapsed = time.perf_counter() - t0
    checksum = sum(p.double().sum().item() for p in model.parameters())
    print(f"{args.mode} rank {rank} loss {loss.item():.8f} checksum {checksum:.8f} "
          f"seconds {elapsed:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

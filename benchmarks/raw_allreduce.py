"""A raw ``torch.distributed`` all-reduce loop under ``torchrun``: the
baseline for ``%dp bench allreduce``.

    torchrun --nproc-per-node 2 benchmarks/raw_allreduce.py --sizes 1024,1048576 --iters 10 --out raw.json

For each size (bytes of float32) every rank runs ``warmup`` all-reduces,
then ``iters`` timed ones, each after a barrier so the ranks start
together.  A call's time is the slowest rank's (the all-reduce is done when
the last rank has its result); rank 0 writes the median over the calls, the
statistic ``%dp bench`` reports, and the mean of ``iters`` back-to-back
calls (the nccl-tests way) beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", required=True, help="comma-separated sizes in bytes")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    dev = models.rank_device(a.backend)
    dist.init_process_group(a.backend, timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    sizes, times, b2b = [], [], []
    for s in (int(x) for x in a.sizes.split(",")):
        numel = max(world, (s // 4 // world) * world)
        t = torch.ones(numel, dtype=torch.float32, device=dev)
        for _ in range(a.warmup):
            dist.all_reduce(t)
        sync()
        mine = []
        for _ in range(a.iters):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            sync()
            mine.append(time.perf_counter() - t0)
        every = [torch.zeros(a.iters, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, torch.tensor(mine, dtype=torch.float64))
        slowest = torch.stack(every).max(dim=0).values
        times.append(float(slowest.median()) if a.iters % 2 else
                     float(slowest.sort().values[a.iters // 2 - 1:a.iters // 2 + 1].mean()))
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            dist.all_reduce(t)
        sync()
        b2b.append((time.perf_counter() - t0) / a.iters)
        sizes.append(numel * 4)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump({"world_size": world, "backend": a.backend, "sizes": sizes,
                       "times_s": times, "back_to_back_s": b2b}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The training loop written by hand, run under ``torchrun``: the baseline
that ``%dp train`` is compared with.

    torchrun --nproc-per-node 2 benchmarks/plain_train.py --configs mlp:ddp,tinylm:zero3 \
        --warmup 5 --steps 20 --out plain.json

With ``--serve DIR`` it stays up and takes commands instead (one JSON line
per command on the FIFO ``DIR/cmd-<rank>``; rank 0 answers on
``DIR/resp``): ``{"op": "setup", "config": "mlp:ddp"}``, ``{"op": "steps",
"n": 10}``, ``{"op": "quit"}``.  The benchmark uses that to alternate
blocks of steps with ``%dp train`` while both sides keep their models.

For each ``model:strategy`` it builds the model and data with the same seed
as the dpnb side (``models.build``), wraps it the way ``%dp wrap`` does
(DDP with ``gradient_as_bucket_view``; ZeRO-1 = DDP + ZeroRedundancyOptimizer;
ZeRO-2/3 = FSDP2 ``fully_shard`` per unit without / with resharding after
forward), reads micro-batches through a ``DistributedSampler`` (seed 0,
shuffled, drop_last), and runs ``warmup`` untimed then ``steps`` timed
AdamW steps: forward, loss, backward (gradients all-reduced or
reduce-scattered inside backward), ``optimizer.step()``, ``zero_grad``.
Rank 0 writes per-step times, the loop's wall time and the final global
loss (one all_reduce at the end) as JSON.
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402


def loss_fn(out, y):
    if y.dtype.is_floating_point:
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def batches(ds, mb, rank, world):
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0,
                                 drop_last=True)
    loader = DataLoader(ds, batch_size=mb, sampler=sampler, drop_last=True)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def wrap(model, strategy, world, dev):
    model.to(dev)
    if strategy in ("ddp", "zero1"):
        wrapped = DDP(model, gradient_as_bucket_view=True,
                      device_ids=[dev.index] if dev.type == "cuda" else None)
        if strategy == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                          lr=1e-3, weight_decay=0.0)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        return wrapped, opt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dev.type, (world,))
    for unit in models.fsdp_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=strategy == "zero3")
    fully_shard(model, mesh=mesh, reshard_after_forward=strategy == "zero3")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)


class Job:
    """One model wrapped with one strategy, its optimizer and its batches."""

    def __init__(self, name, strategy, tiny, rank, world, dev):
        self.name, self.strategy, self.world, self.dev = name, strategy, world, dev
        model, ds, self.mb = models.build(name, tiny)
        self.net, self.opt = wrap(model, strategy, world, dev)
        self.it = batches(ds, self.mb, rank, world)

    def steps(self, n):
        """``n`` steps after a barrier; per-step times, the loop's wall time
        and the last step's loss averaged over the ranks."""
        net, opt, it = self.net, self.opt, self.it
        times = []
        loss_value = float("nan")
        dist.barrier()
        t_loop = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            x, y = next(it)
            x, y = x.to(self.dev, non_blocking=True), y.to(self.dev, non_blocking=True)
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_value = loss.item()
            times.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_loop
        final = torch.tensor([loss_value], dtype=torch.float64, device=self.dev)
        dist.all_reduce(final)
        return {"model": self.name, "strategy": self.strategy, "micro_batch": self.mb,
                "world_size": self.world, "step_times_s": times, "loop_wall_s": wall,
                "steps": n, "final_loss": float(final.item()) / self.world}


def run_one(name, strategy, warmup, steps, tiny, rank, world, dev):
    job = Job(name, strategy, tiny, rank, world, dev)
    if warmup:
        job.steps(warmup)
    return job.steps(steps)


def serve(folder, tiny, rank, world, dev):
    job = None
    resp = None
    with open(os.path.join(folder, f"cmd-{rank}")) as cmds:
        if rank == 0:
            resp = open(os.path.join(folder, "resp"), "w")
        for line in cmds:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "setup":
                name, strategy = cmd["config"].split(":")
                job = Job(name, strategy, tiny, rank, world, dev)
                out = {"ok": True}
            else:
                out = job.steps(int(cmd["n"]))
            if resp is not None:
                resp.write(json.dumps(out) + "\n")
                resp.flush()
    if resp is not None:
        resp.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=None, help="model:strategy,...")
    p.add_argument("--serve", default=None, metavar="DIR", help="take commands from DIR/cmd-<rank>")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                   help="nccl: one GPU per rank (LOCAL_RANK)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not a.serve and not (a.configs and a.out):
        p.error("give --configs and --out, or --serve DIR")
    torch.set_num_threads(1)
    dev = models.rank_device(a.backend)
    # Long: in --serve mode the ranks wait for commands between collectives.
    dist.init_process_group(a.backend, timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.serve:
        serve(a.serve, a.tiny, rank, world, dev)
        dist.destroy_process_group()
        return
    rows = []
    for cfg in a.configs.split(","):
        name, strategy = cfg.split(":")
        rows.append(run_one(name, strategy, a.warmup, a.steps, a.tiny, rank, world, dev))
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"torch": torch.__version__, "backend": dist.get_backend(),
                       "world_size": world, "rows": rows}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Measure, with real PyTorch objects, the bytes each rank holds (run as a script).

Used by test_exact_memory.py in a subprocess: every rank of a world of
WORLD ranks is simulated in turn in this one process with the "fake" process
group backend (torch.testing._internal.distributed.fake_pg), which lets
DDP / ZeroRedundancyOptimizer / FSDP2 build their real per-rank state without
other processes.  Collectives return garbage values, which does not matter
for byte counts.  Prints one JSON document on stdout.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD = 4

from dpnb.engine.train.measure import state_bytes as engine_state_bytes  # the engines' own meter


class Net(torch.nn.Module):
    """Uneven dim-0 sizes (7, 3, 10, 2 over 4 ranks), a frozen and (DDP only) a bf16 parameter."""

    def __init__(self, with_bf16: bool) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(7, 5))
        self.b1 = torch.nn.Parameter(torch.randn(7))
        self.w2 = torch.nn.Parameter(torch.randn(3, 7))
        self.b2 = torch.nn.Parameter(torch.randn(3))
        self.frozen = torch.nn.Parameter(torch.randn(10, 4), requires_grad=False)
        self.big = torch.nn.Parameter(torch.randn(2, 9))
        self.with_bf16 = with_bf16
        if with_bf16:
            self.p_bf16 = torch.nn.Parameter(torch.randn(6, 2, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w1.T + self.b1)
        y = (h @ self.w2.T + self.b2).sum() + self.big.sum() + self.frozen.sum()
        if self.with_bf16:
            y = y + self.p_bf16.float().sum()
        return y


def nbytes(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def storage_bytes(tensors: list) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _local_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def make_opt(params, optimizer: str):
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def opt_bytes(state: dict) -> tuple[int, int]:
    moments = [v for s in state.values() for k, v in s.items() if k != "step"]
    steps = [v for s in state.values() for k, v in s.items() if k == "step"]
    return storage_bytes(moments), storage_bytes(steps)


def measure(strategy: str, optimizer: str, rank: int, bucket_view: bool) -> dict:
    torch.manual_seed(0)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        net = Net(with_bf16=strategy == "ddp")
        names = {id(p): n for n, p in net.named_parameters()}
        out: dict = {}
        if strategy in ("ddp", "zero1"):
            model = DDP(net, gradient_as_bucket_view=bucket_view)
            # The fake backend's all-reduce future carries no tensor, which the
            # reducer rejects; a hook that returns the bucket unchanged keeps
            # DDP's buffers and views intact without communicating.
            model.register_comm_hook(None, _local_hook)
            if strategy == "ddp":
                opt = make_opt(model.parameters(), optimizer)
                state = opt.state
            else:
                if optimizer == "adam":
                    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
                else:
                    opt = ZeroRedundancyOptimizer(
                        model.parameters(), optimizer_class=torch.optim.SGD, lr=1e-3, momentum=0.9
                    )
                state = opt.optim.state
            for _ in range(2):
                model(torch.randn(2, 5)).backward()
                opt.step()
            ps = list(net.parameters())
            grads = [p.grad for p in ps if p.grad is not None]
            out["bucket_bytes"] = sum(nbytes(b.buffer()) for b in model.reducer._get_zeros_like_grad_buckets())
            # With gradient_as_bucket_view the grads *are* the buckets (one copy).
            out["comm_buffers"] = 0 if bucket_view else out["bucket_bytes"]
        else:
            mesh = init_device_mesh("cpu", (WORLD,))
            fully_shard(net, mesh=mesh, reshard_after_forward=(strategy == "zero3"))
            names = {id(p): n for n, p in net.named_parameters()}
            opt = make_opt(net.parameters(), optimizer)
            state = opt.state
            for _ in range(2):
                net(torch.randn(2, 5)).backward()
                opt.step()
            ps = list(net.parameters())
            grads = [p.grad for p in ps if p.grad is not None]
            out["comm_buffers"] = 0
            out["bucket_bytes"] = 0
        out["params"] = storage_bytes(ps)
        out["params_unpadded"] = sum(nbytes(p) for p in ps)
        out["grads"] = sum(nbytes(g) for g in grads)
        out["grad_storage"] = storage_bytes(grads)
        out["optimizer_moments"], out["optimizer_steps"] = opt_bytes(state)
        out["owned"] = sorted(names[id(p)] for p in state)
        eb = engine_state_bytes(net, opt)
        out["engine"] = {k: eb[k] for k in ("params", "grads", "optimizer", "total")}
        out["specs"] = [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in net.named_parameters()]
        return out
    finally:
        dist.destroy_process_group()


def measure_ddp_rebuild(dims: list[int], bucket_cap_mb: float | None) -> dict:
    """DDP's rebuilt buckets (after the first iterations) for an MLP of widths ``dims``."""
    torch.manual_seed(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        layers: list[torch.nn.Module] = []
        for a, b in zip(dims, dims[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        net = torch.nn.Sequential(*layers)
        model = DDP(net, bucket_cap_mb=bucket_cap_mb)
        model.register_comm_hook(None, _local_hook)
        # Iteration 1 records the ready order, 2 rebuilds, 3 logs the result.
        for _ in range(3):
            model(torch.randn(2, dims[0])).sum().backward()
        info = model._get_ddp_logging_data()
        buckets = [[int(i) for i in b.split()] for b in info["rebuilt_per_bucket_param_indices"].split(",")]
        return {
            "dims": dims,
            "bucket_cap_mb": bucket_cap_mb,
            "param_bytes": [p.numel() * p.element_size() for p in net.parameters()],
            "buckets": buckets,
            "sizes": [int(x) for x in info["rebuilt_bucket_sizes"].split(",")],
        }
    finally:
        dist.destroy_process_group()


def main() -> None:
    results = []
    for strategy, optimizer, bucket_view in [
        ("ddp", "adam", False),
        ("ddp", "adam", True),
        ("zero1", "adam", False),
        ("zero1", "sgd-momentum", True),
        ("zero3", "adam", False),
        ("zero3", "sgd-momentum", False),
        ("zero2", "adam", False),
    ]:
        ranks = [measure(strategy, optimizer, r, bucket_view) for r in range(WORLD)]
        results.append({"strategy": strategy, "optimizer": optimizer, "bucket_view": bucket_view, "ranks": ranks})
    rebuilds = [
        measure_ddp_rebuild([64, 700, 300, 900, 500, 1000, 200, 64], None),
        measure_ddp_rebuild([32, 400, 400, 400, 400, 400, 8], 1),
        measure_ddp_rebuild([16, 900, 160, 700, 160, 16], 0.5),
    ]
    json.dump({"world": WORLD, "results": results, "ddp_rebuilds": rebuilds}, sys.stdout)


if __name__ == "__main__":
    main()

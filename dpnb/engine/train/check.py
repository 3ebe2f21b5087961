"""``%dp check``: are the replicas really in sync?

Data parallelism is only correct if every rank holds the same model after
every step.  :func:`check` verifies it with collectives, so **all ranks must
call it together**:

1. one ``all_reduce(MAX)`` of a hash of the tensor names/shapes/dtypes -- if
   the ranks hold differently built models nothing else is compared (the
   following collectives would not line up);
2. FSDP parameters (DTensors) are gathered to full tensors
   (``full_tensor()``, an all-gather per parameter); DDP/ZeRO-1 parameters and
   all buffers are used as they are;
3. an ``all_gather`` of a per-tensor fingerprint (sum, sum of squares, a
   position-weighted sum, NaN count) tells *which* ranks differ from rank 0;
4. an exact element-wise comparison: the values are concatenated in float64
   chunks and reduced with ``all_reduce(MAX)`` and ``all_reduce(MIN)``; a
   tensor is in sync iff max == min everywhere.  This catches any difference,
   down to the last bit, that a checksum could miss.

What "in sync" means per strategy: for ddp/zero1 every rank holds a full
replica of each parameter, so a perturbed parameter on one rank is reported.
For zero2/zero3 each parameter element lives on exactly one rank (its dim-0
shard) -- there is no replica to disagree with, so a perturbed shard shows up
only as a changed checksum, identically on all ranks.  What *can* go out of
sync under FSDP is checked: replicated tensors (buffers, anything not
sharded), the all-gathered full parameters (every rank must assemble the same
tensor), and each rank's shard layout against the global shape.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dpnb.compat import is_dtensor, local_tensor
from dpnb.engine.state import get_state
from dpnb.engine.train.train_state import TrainError, require_bound

__all__ = ["check"]

_NAN = 7.7e307  # stands in for NaN so MAX/MIN compare it like a value


def _module_for(ns, model_name):
    if model_name is None:
        st = require_bound(ns)
        return st.module, st.strategy
    if model_name not in ns:
        raise TrainError(f"there is no {model_name!r} on this rank to check")
    m = ns[model_name]
    if isinstance(m, DDP):
        m = m.module
    if not isinstance(m, torch.nn.Module):
        raise TrainError(f"{model_name!r} is not a torch.nn.Module")
    return m, "unwrapped"


def _expected_rows(d0: int, n: int, r: int) -> int:
    c = math.ceil(d0 / n) if d0 else 0
    return max(0, min(c, d0 - r * c))


def _gather_full(t, ws: int, cdev) -> torch.Tensor:
    """The full tensor of a DTensor.  For FSDP2's dim-0 sharding this is one
    ``all_gather`` of the (padded) local shards over the mesh's group, done
    here rather than by ``full_tensor()`` so that shards FSDP keeps in host
    memory (``cpu_offload``) are gathered on the communication device."""
    # lazy: FSDP/DTensor load only for the strategy that uses them
    from torch.distributed.tensor import Shard

    mesh = t.device_mesh
    if mesh.ndim == 1 and tuple(t.placements) == (Shard(0),) and t.dim() > 0 and mesh.size() == ws:
        loc = local_tensor(t).detach().to(cdev)
        d0 = t.shape[0]
        chunk = math.ceil(d0 / ws)
        padded = torch.zeros((chunk, *t.shape[1:]), dtype=loc.dtype, device=cdev)
        padded[: loc.shape[0]] = loc
        bufs = [torch.empty_like(padded) for _ in range(ws)]
        dist.all_gather(bufs, padded, group=mesh.get_group())
        return torch.cat(bufs)[:d0]
    return t.full_tensor()


def _fingerprints(fulls: list, ws: int, cdev) -> torch.Tensor:
    """Four numbers per tensor from every rank (one all_gather): ``(ws, T, 4)``."""
    fp = torch.zeros(len(fulls), 4, dtype=torch.float64, device=cdev)
    for i, x in enumerate(fulls):
        if x.numel():
            isn = x == _NAN
            clean = torch.where(isn, torch.zeros_like(x), x)
            w = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=cdev)
            fp[i, 0] = clean.sum()
            fp[i, 1] = (clean * clean).sum()
            fp[i, 2] = (clean * torch.sin(w)).sum()
            fp[i, 3] = isn.sum()
    gathered = [torch.empty_like(fp) for _ in range(ws)]
    dist.all_gather(gathered, fp)
    return torch.stack(gathered).cpu()


def _exact_diffs(fulls: list, chunk_mb: float, cdev) -> tuple[list[int], list[float]]:
    """Elements that differ and the largest difference per tensor: an all_reduce
    MAX and MIN of each chunk (chunked to bound the extra memory)."""
    n_diff = [0] * len(fulls)
    max_diff = [0.0] * len(fulls)
    limit = max(1, int(chunk_mb * 2**20 / 8))
    i = 0
    while i < len(fulls):
        j, size = i, 0
        while j < len(fulls) and (j == i or size + fulls[j].numel() <= limit):
            size += fulls[j].numel()
            j += 1
        buf = torch.cat(fulls[i:j]) if size else torch.zeros(0, dtype=torch.float64, device=cdev)
        hi, lo = buf.clone(), buf.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        off = 0
        for k in range(i, j):
            n = fulls[k].numel()
            d = (hi[off : off + n] - lo[off : off + n]).abs()
            nd = int((d != 0).sum())
            n_diff[k] = nd
            max_diff[k] = float(d.max()) if nd else 0.0
            off += n
        i = j
    return n_diff, max_diff


def check(ns: dict, *, model_name: str | None = None, max_report: int = 20, chunk_mb: float = 64) -> dict:
    """Compare every parameter and buffer across ranks (collective).

    Returns a dict of builtins: ``ok``; ``mismatches`` -- one entry per tensor
    that differs, with ``name``, ``kind`` (parameter/buffer), ``sharded``,
    ``n_diff`` (elements that differ), ``max_abs_diff``, ``ranks_differing``
    (ranks whose fingerprint differs from rank 0's); ``checksums`` -- the sum
    of each (full) tensor on this rank; ``layout_errors`` for FSDP shards.
    """
    es = get_state(ns)
    module, strategy = _module_for(ns, model_name)
    ws, rank = es.world_size, es.rank
    cdev = es.comm_device

    tensors = [(n, "parameter", p) for n, p in module.named_parameters()]
    tensors += [(n, "buffer", b) for n, b in module.named_buffers()]
    desc = "\n".join(f"{k}:{n}:{tuple(t.shape)}:{t.dtype}" for n, k, t in tensors)
    sig = zlib.crc32(desc.encode())
    probe = torch.tensor([sig, -sig], dtype=torch.int64, device=cdev)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    if int(probe[0]) != sig or -int(probe[1]) != sig:
        return {
            "ok": False,
            "strategy": strategy,
            "rank": rank,
            "world_size": ws,
            "error": "the ranks hold differently built models (tensor names, shapes "
            "or dtypes differ); build the model the same way on every rank",
            "mismatches": [],
            "n_tensors": len(tensors),
        }

    fulls = []
    sharded = []
    layout_errors = []
    for name, kind, t in tensors:
        t = t.detach()
        if is_dtensor(t):
            sharded.append(name)
            loc = local_tensor(t)
            if t.dim() > 0:
                exp = _expected_rows(t.shape[0], ws, rank)
                if loc.shape[0] != exp or tuple(loc.shape[1:]) != tuple(t.shape[1:]):
                    layout_errors.append(
                        f"{name}: local shard {tuple(loc.shape)} but rank {rank} of {ws} "
                        f"should hold {exp} rows of {tuple(t.shape)}"
                    )
            t = _gather_full(t, ws, cdev)
        x = t.reshape(-1).to(device=cdev, dtype=torch.float64)
        fulls.append(torch.nan_to_num(x, nan=_NAN))

    allfp = _fingerprints(fulls, ws, cdev)  # (ws, T, 4): which ranks differ from rank 0
    n_diff, max_diff = _exact_diffs(fulls, chunk_mb, cdev)

    bad = torch.tensor([len(layout_errors)], dtype=torch.int64, device=cdev)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)

    mismatches = []
    for k, (name, kind, _) in enumerate(tensors):
        if n_diff[k] == 0:
            continue
        differing = [r for r in range(ws) if not torch.equal(allfp[r, k], allfp[0, k])]
        mismatches.append(
            {
                "name": name,
                "kind": kind,
                "sharded": name in sharded,
                "n_diff": n_diff[k],
                "numel": fulls[k].numel(),
                "max_abs_diff": max_diff[k] if max_diff[k] < 1e307 else float("nan"),
                "ranks_differing": differing,
            }
        )
    checksums = {name: float(allfp[rank, k, 0]) for k, (name, _, _) in enumerate(tensors[:500])}
    ok = not mismatches and int(bad.item()) == 0
    return {
        "ok": ok,
        "strategy": strategy,
        "rank": rank,
        "world_size": ws,
        "n_tensors": len(tensors),
        "n_elements": int(sum(x.numel() for x in fulls)),
        "n_mismatched": len(mismatches),
        "mismatches": mismatches[:max_report],
        "sharded": sharded,
        "layout_errors": layout_errors,
        "layout_errors_any_rank": int(bad.item()),
        "checksums": checksums,
        "summary": (
            f"{len(tensors)} tensors in sync across {ws} ranks"
            if ok
            else f"{len(mismatches)} tensor(s) differ across ranks: "
            + ", ".join(m["name"] for m in mismatches[:5])
            + ("" if int(bad.item()) == 0 else "; FSDP shard layout errors")
        ),
    }

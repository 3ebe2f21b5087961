"""The GPU benchmark: dpnb on one GPU against the same loop under torchrun.

    python benchmarks/gpu.py [--steps 30] [--json out.json]

Needs a CUDA GPU (it says so and exits 0 without one).  World size 1, NCCL:

* start: ``dpnb.start(1, backend="nccl")`` to a ready process group;
* step time: ``%dp train`` (recording on) vs ``plain_train.py --backend nccl``
  under ``torchrun --nproc-per-node 1``, MLP and TinyLM under ddp, zero1,
  zero2, zero3 (median of per-step times; both sides synchronise the device
  inside the step: dpnb before timing the step, the plain loop by
  ``loss.item()``);
* memory: the model states the rank holds after the optimizer step
  (parameters, gradients, optimizer state, counted from its tensors) beside
  :func:`dpnb.core.exact_rank_bytes` for the same parameters -- like for
  like; CUDA's allocated bytes are shown apart, as they also hold the
  activations, DDP's buckets and the allocator's rounding;
* all-reduce busbw at world size 1 (a sanity floor: no link is crossed).

Prints a markdown table; the numbers belong in RESULTS.md with the GPU named.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def _dpnb_side(steps: int) -> tuple[dict, list[dict]]:
    import dpnb
    import dpnb.session.verbs
    from suite import SETUP_CELL

    t0 = time.perf_counter()
    c = dpnb.start(1, backend="nccl")
    start_s = time.perf_counter() - t0
    rows = []
    try:
        for name in ("mlp", "tinylm"):
            for strategy in STRATEGIES:
                c.run(SETUP_CELL.format(here=HERE, name=name, tiny=False), display=False)
                c.wrap("net", strategy)
                c.set_data("ds")
                mb = int(c.pull("mb", rank=0))
                c.train(steps=5, micro_batch=mb, progress=False)  # warm-up
                c.train(steps=steps, micro_batch=mb, progress=False)
                recs = dpnb.session.verbs.records(c, last=steps)[0]
                snap = c.call("dpnb.engine.metrics.views.memory_snapshot").values[0]
                rows.append({"model": name, "strategy": strategy, "micro_batch": mb,
                             "step_ms": 1e3 * statistics.median(r["step_time_s"] for r in recs),
                             "measured": snap["measured"], "snapshot": snap})
        bench = c.call("dpnb.engine.metrics.views.bench_allreduce", [2**20, 2**24, 2**26], 10).values[0]
    finally:
        c.stop()
    return {"start_s": start_s, "allreduce": bench, "gpu": _gpu_name()}, rows


def _plain_side(steps: int) -> dict:
    from suite import torchrun

    out = os.path.join(tempfile.mkdtemp(prefix="dpnb-gpu-"), "plain.json")
    cfgs = ",".join(f"{m}:{s}" for m in ("mlp", "tinylm") for s in STRATEGIES)
    torchrun("plain_train.py", ["--configs", cfgs, "--warmup", "5", "--steps", str(steps),
                                "--backend", "nccl", "--out", out], nproc=1)
    with open(out) as f:
        rows = json.load(f)["rows"]
    return {(r["model"], r["strategy"]): 1e3 * statistics.median(r["step_times_s"]) for r in rows}


def _predicted(snap: dict) -> int:
    from dpnb.core import ParamSpec, exact_rank_bytes

    specs = [ParamSpec(n, tuple(s), d, t) for n, s, d, t in snap["specs"]]
    per_rank = exact_rank_bytes(specs, snap["world_size"], snap["strategy"], snap["optimizer"],
                                gradient_as_bucket_view=snap["gradient_as_bucket_view"])
    return int(per_rank[snap["rank"]].total)


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu.py: no CUDA GPU on this machine; nothing measured")
        return 0
    info, rows = _dpnb_side(a.steps)
    plain = _plain_side(a.steps)
    print(f"GPU: {info['gpu']}, torch {torch.__version__}, world size 1, NCCL")
    print(f"start to a ready group: {info['start_s']:.2f} s")
    print("| model | strategy | dpnb step ms | torchrun step ms | ratio | model states "
          "measured | predicted | CUDA allocated (all) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = plain[(r["model"], r["strategy"])]
        print(f"| {r['model']} | {r['strategy']} | {r['step_ms']:.2f} | {base:.2f} | "
              f"{r['step_ms'] / base:.3f} | {r['measured'].get('total')} | "
              f"{_predicted(r['snapshot'])} | {r['measured'].get('allocated')} |")
    print("all-reduce (world size 1):", json.dumps(info["allreduce"])[:400])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"info": info, "rows": rows, "plain": {f"{k[0]}:{k[1]}": v
                                                             for k, v in plain.items()}},
                      f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Step time per strategy on a live cluster, and the cost of recording.

Trains the character-level TinyLM under ddp, zero1, zero2 and zero3 on the
same cluster, with bucket/byte recording on and off, and reports the median
step time over the measured steps (the first steps, which include DDP's
bucket rebuild and allocator warm-up, are dropped).

    python benchmarks/strategies.py -n 2 --steps 30 --json strategies.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import dpnb

CELL = """
import dpnb.data
torch.manual_seed(0)
ds = dpnb.data.CharTextDataset(seq_len={seq})
net = dpnb.data.TinyLM(ds.vocab_size, d_model={d}, n_layers={layers}, n_heads=4, seq_len={seq})
"""


def run(n: int, steps: int, warmup: int, d: int, layers: int, seq: int, micro_batch: int) -> dict:
    c = dpnb.start(n, timeout=60)
    rows = []
    try:
        for strategy in ("ddp", "zero1", "zero2", "zero3"):
            for record in (False, True):
                c.run(CELL.format(seq=seq, d=d, layers=layers), display=False)
                info = c.wrap("net", strategy, lr=1e-3)
                c.set_data("ds")
                s = c.train(steps=warmup + steps, micro_batch=micro_batch, seq_len=seq,
                            record=record, progress=False)
                recs = dpnb.session.verbs.records(c, last=steps)[0]
                times = [r["step_time_s"] for r in recs]
                rows.append({
                    "strategy": strategy, "record": record, "params": info["n_params"],
                    "median_step_ms": round(1e3 * statistics.median(times), 2),
                    "min_step_ms": round(1e3 * min(times), 2),
                    "max_step_ms": round(1e3 * max(times), 2),
                    "samples_per_s": round(s["global_batch"] / statistics.median(times), 1),
                    "final_loss": round(s["loss"], 4),
                })
                print(rows[-1], flush=True)
    finally:
        c.stop()
    return {"n": n, "steps": steps, "warmup": warmup, "model": {"d_model": d, "layers": layers,
            "seq_len": seq}, "micro_batch": micro_batch, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    out = run(a.n, a.steps, a.warmup, a.d_model, a.layers, a.seq_len, a.micro_batch)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

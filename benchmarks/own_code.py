"""Users' own training loops in a ``%%dp`` cell against the same file under torchrun.

    python benchmarks/own_code.py [--rounds 5] [--steps 40] [--width 256] [--json out.json]

The code is ``tests/ecosystem/scripts/handwritten.py``, unchanged, in three
modes: ``ddp`` (data parallelism by hand: one ``all_reduce`` per gradient),
``zero`` (a ZeRO-2 step by hand: ``reduce_scatter_single`` of the flattened
gradients, a step on the local shard, ``all_gather_single`` of the
parameters) and ``torchddp`` (``DistributedDataParallel`` built by the script,
with its own loop).  The notebook side pastes the file's text into a cell
(``sys.argv`` set first, so its argparse reads the same options), on a 2-rank
dpnb cluster, with the cell guard's checks on (and, for ``zero``, also with
``--unchecked``); the other side runs the file under ``torchrun
--nproc-per-node 2``.  Each side times its own loop (after warm-up steps and a
barrier; the slowest rank counts), the sides alternate A B A B, and the ratio
is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), "tests", "ecosystem", "scripts", "handwritten.py")


def _seconds(text: str) -> float:
    return max(float(x) for x in re.findall(r"seconds ([0-9.]+)", text))


def torchrun_side(argv: list[str]) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", SCRIPT, *argv], env=env, capture_output=True,
                       text=True, timeout=600)
    if p.returncode:
        raise RuntimeError(p.stdout + p.stderr)
    return _seconds(p.stdout)


def dpnb_side(c, argv: list[str], unchecked: bool = False) -> float:
    with open(SCRIPT) as f:
        src = f.read()
    cell = f"import sys\nsys.argv = {['handwritten.py', *argv]!r}\n" + src
    res = c.run(cell, display=False, unchecked=unchecked)
    return _seconds("".join(o.stdout for o in res.outcomes.values()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import dpnb

    c = dpnb.start(2, threads=1)
    out: dict = {}
    try:
        cases = [("ddp", False), ("zero", False), ("zero", True), ("torchddp", False)]
        for mode, unchecked in cases:
            args = ["--mode", mode, "--steps", str(a.steps), "--width", str(a.width)]
            dpnb_side(c, args, unchecked)  # warm both sides once
            torchrun_side(args)
            ds, ts, rs = [], [], []
            for i in range(a.rounds):
                if i % 2:
                    t = torchrun_side(args)
                    d = dpnb_side(c, args, unchecked)
                else:
                    d = dpnb_side(c, args, unchecked)
                    t = torchrun_side(args)
                ds.append(d)
                ts.append(t)
                rs.append(d / t)
            name = mode + (" --unchecked" if unchecked else "")
            out[name] = {"dpnb_s": round(statistics.median(ds), 4),
                         "torchrun_s": round(statistics.median(ts), 4),
                         "ratio": round(statistics.median(rs), 3),
                         "ratio_range": [round(min(rs), 3), round(max(rs), 3)]}
            print(f"{name}: {out[name]}", flush=True)
    finally:
        c.stop()
    print("\n| loop in a cell | dpnb | torchrun | ratio (min-max) |\n|---|---|---|---|")
    for name, v in out.items():
        print(f"| {name} | {v['dpnb_s'] * 1e3:.1f} ms | {v['torchrun_s'] * 1e3:.1f} ms | "
              f"{v['ratio']:.3f} ({v['ratio_range'][0]:.3f}-{v['ratio_range'][1]:.3f}) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

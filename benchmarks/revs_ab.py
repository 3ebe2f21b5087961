"""dpnb's cell path against another revision's, two live clusters, calls alternated.

    python benchmarks/revs_ab.py --old-root /tmp/old41 [-n 2] [--rounds 40]

``--old-root`` is a checkout of the other revision (``git worktree add
/tmp/old41 REV``).  Each side runs in its own subprocess (this file with
``--serve``) whose ``PYTHONPATH`` is that side's checkout, so its IPython
shell, its ``%dp start -n N`` and the engines it starts all import that
revision's dpnb.  The parent alternates single calls between the two sides
(which side goes first flips every round): a ``pass`` cell, an all-reduce
cell, a pull, and a ``%dp train`` of a few steps of a tiny MLP under DDP
(recording on, as users run it).  Each side times its own call; the table
gives each side's median and the median of the per-round ratios new / old,
so a machine that drifts moves both sides of a pair together.  The loop's
own Python is ``loop_ab.py``'s; this is what surrounds it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

ALLREDUCE_SETUP = "import torch, torch.distributed as dist\n_t = torch.ones(1024)\nx = list(range(100))"
ALLREDUCE = "dist.all_reduce(_t)"
SETUP_CELL = """
import sys
if {here!r} not in sys.path:
    sys.path.insert(0, {here!r})
import models
net, ds, mb = models.build("mlp", tiny=True)
"""
TRAIN_STEPS = 3
OPS = ("pass cell", "all_reduce cell", "pull", f"%dp train --steps {TRAIN_STEPS}", "train step")


def serve(n: int) -> None:
    """One side: a shell with dpnb loaded and an N-rank cluster; answers
    ``{"op": ...}`` lines on stdin with timings on the stdout it started with
    (what the magics print goes to a buffer)."""
    from IPython.core.interactiveshell import InteractiveShell

    import dpnb
    import dpnb.session.verbs

    out = os.fdopen(os.dup(1), "w")
    sys.stdout = io.StringIO()
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "dpnb")
    sh.run_line_magic("dp", f"start -n {n} --backend gloo")
    c = dpnb.get_cluster(sh)
    try:
        sh.run_cell_magic("dp", "", ALLREDUCE_SETUP)
        c.run(SETUP_CELL.format(here=HERE), display=False)
        sh.run_line_magic("dp", "wrap net --strategy ddp")
        sh.run_line_magic("dp", "data ds")
        mb = int(c.pull("mb", rank=0))
        calls = {
            "pass cell": lambda: sh.run_cell_magic("dp", "", "pass"),
            "all_reduce cell": lambda: sh.run_cell_magic("dp", "", ALLREDUCE),
            "pull": lambda: c.pull("x"),
            OPS[3]: lambda: sh.run_line_magic("dp", f"train --steps {TRAIN_STEPS} --micro-batch {mb}"),
        }
        out.write(json.dumps({"ready": dpnb.__file__}) + "\n")
        out.flush()
        for line in sys.stdin:
            op = json.loads(line)["op"]
            if op == "quit":
                break
            with contextlib.redirect_stdout(io.StringIO()):
                t0 = time.perf_counter()
                calls[op]()
                got = {"s": time.perf_counter() - t0}
            if op == OPS[3]:
                recs = dpnb.session.verbs.records(c, last=TRAIN_STEPS)[0]
                got["step_s"] = statistics.median(r["step_time_s"] for r in recs)
            out.write(json.dumps(got) + "\n")
            out.flush()
    finally:
        c.stop()


class Side:
    def __init__(self, root: str, n: int, log: str):
        env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", "-n", str(n)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, cwd=root)
        self.ready = self._read()["ready"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"side exited ({self.proc.poll()}); see {self.log.name}")
        return json.loads(line)

    def ask(self, op: str) -> dict:
        self.proc.stdin.write(json.dumps({"op": op}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(60)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old-root", help="checkout of the revision to compare with")
    p.add_argument("--new-root", default=ROOT, help="checkout measured as new (default: this one)")
    p.add_argument("-n", type=int, default=2)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        serve(a.n)
        return 0
    if not a.old_root:
        p.error("--old-root is required")
    sides = {}
    try:
        for name, root in (("old", a.old_root), ("new", a.new_root)):
            sides[name] = Side(root, a.n, f"/tmp/revs_ab-{name}.log")
            print(f"{name}: {sides[name].ready}", flush=True)
        t = {k: {op: [] for op in OPS} for k in sides}
        t0 = time.perf_counter()
        for i in range(a.warmup + a.rounds):
            for op in OPS[:4]:
                order = ("old", "new") if i % 2 == 0 else ("new", "old")
                for k in order:
                    got = sides[k].ask(op)
                    if i >= a.warmup:
                        t[k][op].append(got["s"])
                        if "step_s" in got:
                            t[k]["train step"].append(got["step_s"])
        took = time.perf_counter() - t0
    finally:
        for s in sides.values():
            s.close()
    print(f"\n{a.n} ranks, gloo, {a.rounds} rounds (+{a.warmup} warm-up), {took:.0f} s of calls\n")
    print("| call | old median ms | new median ms | median of per-round new/old | IQR of ratios |")
    print("|---|---|---|---|---|")
    for op in OPS:
        o, nw = t["old"][op], t["new"][op]
        r = sorted(x / y for x, y in zip(nw, o))
        q = statistics.quantiles(r, n=4)
        print(f"| {op} | {1e3 * statistics.median(o):.2f} | {1e3 * statistics.median(nw):.2f} | "
              f"{statistics.median(r):.3f} | {q[0]:.3f}-{q[2]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

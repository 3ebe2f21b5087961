"""Soak: repeated train / fault / recover cycles on a real local cluster.

Each cycle trains a few steps, injects one fault chosen at random, recovers
the way a user would (the automatic group re-formation, or ``restart`` with
``resume`` when an engine died: from a survivor's replica, ddp's memory), then proves the cluster
is healthy: the replicas are in sync and an all_reduce gives the right sum.

Recorded: cycles, faults by kind, recovered count, time from injecting a
fault to a healthy cluster, engine memory (RSS) and the notebook process's
open file descriptors over time, and leftover processes after ``stop``.

    python benchmarks/soak.py --minutes 10 --json soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time

import psutil

import dpnb
from dpnb.errors import RemoteCellError

SETUP = """
import dpnb.data
torch.manual_seed(0)
ds = dpnb.data.SyntheticRegression(n=512, in_dim=16, out_dim=1, seed=0)
net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
"""

FAULTS = ("raise_mid_collective", "exit_engine", "sigkill_engine", "hang_cell_timeout",
          "ctrl_c_training", "shape_mismatch", "one_sided_collective", "mismatched_ops",
          "kill_during_checkpoint")
CELL_TIMEOUT_S = 3.0


def _fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


def _healthy(c) -> None:
    res = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == world_size",
                display=False)
    assert res.ok
    assert c.check()["ok"], "replicas out of sync"


def _mistake(c, kind: str, victim: int) -> str:
    """A collective typed wrong in a cell: the engines must all survive it."""
    pids = [r.pid for r in c.ranks]
    code = {
        "shape_mismatch": f"t = torch.ones(4 + (rank == {victim}))\ndist.all_reduce(t)",
        "mismatched_ops": (f"t = torch.ones(4)\nif rank == {victim}:\n    dist.broadcast(t, src=0)"
                           "\nelse:\n    dist.all_reduce(t)"),
        "one_sided_collective": f"t = torch.ones(4)\nif rank == {victim}:\n    dist.all_reduce(t)",
    }[kind]
    try:
        c.run(code, display=False, timeout=CELL_TIMEOUT_S)
    except RemoteCellError as e:
        assert [r.pid for r in c.ranks] == pids and not c.dead, e.report
        return "reported, engines kept"
    raise AssertionError(f"{kind} was not reported")


def _kill_during_checkpoint(c, victim: int, auto: str) -> str:
    pid = c.ranks[victim].pid
    killer = threading.Timer(0.8, lambda: os.kill(pid, signal.SIGKILL))
    killer.start()
    try:
        c.train(steps=400, micro_batch=8, progress=False, checkpoint_every=2, checkpoint_dir=auto)
    except RemoteCellError as e:
        assert victim in e.died, e.report
    finally:
        killer.join()
    return _resume(c)


def _resume(c) -> str:
    """``restart --resume`` with no folder: a survivor's replica (ddp), else the disk."""
    msg = c.restart(resume=True)
    return "restart --resume (" + ("from memory" if "replica" in msg else "from disk") + ")"


def _inject(c, kind: str, rng: random.Random, ckpt: str, auto: str = "") -> str:
    """Inject one fault; return how it was recovered."""
    victim = rng.randrange(c.world_size)
    if kind in ("shape_mismatch", "mismatched_ops", "one_sided_collective"):
        return _mistake(c, kind, victim)
    if kind == "kill_during_checkpoint":
        return _kill_during_checkpoint(c, victim, auto)
    if kind == "raise_mid_collective":
        try:
            c.run(f"t = torch.ones(1)\nif rank == {victim}:\n    raise ValueError('soak')\n"
                  "dist.all_reduce(t)", display=False)
        except RemoteCellError as e:
            assert e.reformed, e.report
            return "auto re-form"
        raise AssertionError("fault was not reported")
    if kind in ("exit_engine", "sigkill_engine"):
        code = ("os._exit(5)" if kind == "exit_engine"
                else "os.kill(os.getpid(), signal.SIGKILL)")
        try:
            c.run(f"import os, signal\nif rank == {victim}:\n    {code}\ndist.barrier()",
                  display=False)
        except RemoteCellError as e:
            assert victim in e.died, e.report
        else:
            raise AssertionError("death was not reported")
        return _resume(c)
    if kind == "hang_cell_timeout":
        try:
            c.run(f"import time\nt = torch.ones(1)\nif rank == {victim}:\n    time.sleep(60)\n"
                  "else:\n    dist.all_reduce(t)", timeout=CELL_TIMEOUT_S, display=False)
        except RemoteCellError as e:
            assert e.timed_out == [victim], e.report
        else:
            raise AssertionError("hang was not reported")
        if c.busy or not c.group_ok:
            c.restart()
            return "restart"
        return "interrupt + auto re-form"
    if kind == "ctrl_c_training":
        timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        s = c.train(steps=10_000, micro_batch=8, loss_fn="slow_loss", progress=False)
        timer.join()
        assert s["interrupted"], s
        return "stopped at step boundary"
    raise ValueError(kind)


def run_soak(seconds: float, seed: int = 0, n: int = 2, timeout: float = 30.0,
             log=print) -> dict:
    rng = random.Random(seed)
    t_start = time.monotonic()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    c = dpnb.start(n, timeout=timeout)
    ckpt = os.path.join(tempfile.mkdtemp(prefix="dpnb-soak-"), "ckpt")
    auto = os.path.join(os.path.dirname(ckpt), "auto")
    counts = {k: 0 for k in FAULTS}
    by_kind: dict[str, list[float]] = {k: [] for k in FAULTS}
    recovered = 0
    recover_s: list[float] = []
    rss: dict[int, list[int]] = {}
    fds = [_fds()]
    cycles = 0
    try:
        c.run(SETUP + "\nimport time\ndef slow_loss(out, target):\n    time.sleep(0.05)\n"
              "    return torch.nn.functional.mse_loss(out, target)\n", display=False, setup=True)
        c.wrap("net", "ddp", lr=0.01)
        c.set_data("ds")
        c.train(steps=2, micro_batch=8, progress=False)
        c.save(ckpt)
        while time.monotonic() - t_start < seconds:
            cycles += 1
            c.train(steps=3, micro_batch=8, progress=False)
            kind = FAULTS[rng.randrange(len(FAULTS))]
            counts[kind] += 1
            t0 = time.monotonic()
            how = _inject(c, kind, rng, ckpt, auto)
            _healthy(c)
            dt = time.monotonic() - t0
            recovered += 1
            recover_s.append(dt)
            by_kind[kind].append(dt)
            for row in c.status():
                rss.setdefault(row["pid"], []).append(row["rss_bytes"] or 0)
            fds.append(_fds())
            log(f"cycle {cycles}: {kind} -> {how}, healthy after {dt:.1f} s")
    finally:
        pids = c.stop()
    time.sleep(1.0)
    leaked = sorted(p.pid for p in psutil.Process().children(recursive=True)
                    if p.pid not in before and p.is_running()
                    and p.status() != psutil.STATUS_ZOMBIE)
    long_lived = {pid: v for pid, v in rss.items() if len(v) >= 3}
    growth = {pid: (v[-1] - v[1]) for pid, v in long_lived.items()}  # v[0]: warm-up
    oldest = max(rss.items(), key=lambda kv: len(kv[1]), default=(None, []))
    return {
        "seconds": round(time.monotonic() - t_start, 1),
        "cycles": cycles,
        "faults": counts,
        "injected": sum(counts.values()),
        "recovered": recovered,
        "recover_s_median": round(statistics.median(recover_s), 2) if recover_s else None,
        "recover_s_max": round(max(recover_s), 2) if recover_s else None,
        "healthy_after_s_median_by_fault": {k: round(statistics.median(v), 2)
                                            for k, v in by_kind.items() if v},
        "group_timeout_s": timeout,
        "engine_rss_growth_mb": {str(k): round(v / 2**20, 1) for k, v in growth.items()},
        # the engine that lived through the most cycles: its memory over time
        "longest_engine": {"cycles": len(oldest[1]),
                           "rss_mb": [round(x / 2**20, 1) for x in oldest[1]]},
        "fds_first_last": (fds[0], fds[-1]),
        "fds_max": max(fds),
        "stopped_pids": len(pids),
        "leaked_pids": leaked,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-n", type=int, default=2)
    p.add_argument("--json", default=None, help="write the summary here")
    a = p.parse_args(argv)
    out = run_soak(a.minutes * 60, seed=a.seed, n=a.n)
    text = json.dumps(out, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    ok = out["recovered"] == out["injected"] and not out["leaked_pids"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

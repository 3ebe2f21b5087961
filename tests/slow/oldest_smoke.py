"""A 2-rank smoke run of dpnb's public Python API, for a venv with other versions.

Run by ``tests/slow/test_oldest_versions.py`` with the Python of a fresh venv
that holds the oldest torch and ipyparallel pyproject.toml allows (not
collected by pytest itself: the name does not start with ``test_``)::

    python tests/slow/oldest_smoke.py [--strategies ddp,zero1,zero3]

It starts 2 gloo engines (``dpnb.start``), checks that a cell's
``dist.all_reduce`` gives the sum on both ranks, builds a small model and its
data in a cell, wraps it (``c.wrap``), trains a few steps (``c.train``),
checks that the loss went down and the replicas agree (``c.check``), and
stops the cluster.  Exit status 0 and a last line ``SMOKE PASSED`` when all
held; otherwise the failed check's message and status 1.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

SETUP = """
import dpnb.data
torch.manual_seed(0)
ds = dpnb.data.SyntheticRegression(n=256, in_dim=8, out_dim=1, seed=0)
net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default="ddp",
                    help="comma-separated dpnb strategies to wrap and train (default: ddp)")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)

    import ipykernel
    import ipyparallel
    import torch

    import dpnb

    print(f"torch {torch.__version__}, ipyparallel {ipyparallel.__version__}, "
          f"ipykernel {ipykernel.__version__}, python {sys.version.split()[0]}", flush=True)
    t0 = time.monotonic()
    c = dpnb.start(2, timeout=60)
    try:
        print(f"started 2 ranks in {time.monotonic() - t0:.1f} s, backend {c.backend}", flush=True)
        assert c.backend == "gloo", c.backend
        assert [r.rank for r in c.ranks] == [0, 1], c.ranks

        res = c.run("t = torch.tensor([float(rank + 1)])\ndist.all_reduce(t)\n"
                    "who = (rank, world_size, dist.get_rank(), dist.get_world_size())",
                    display=False)
        assert res.ok, res
        sums = [t.tolist() for t in c.pull("t")]
        assert sums == [[3.0], [3.0]], f"all_reduce of rank+1 over 2 ranks gave {sums}"
        assert c.pull("who") == [(0, 2, 0, 2), (1, 2, 1, 2)], c.pull("who")
        print("all_reduce: both ranks hold 3.0", flush=True)
        # torch 2.13's names, as the course writes them: dpnb gives an older torch them
        res = c.run("s = torch.zeros(1)\n"
                    "dist.reduce_scatter_single(s, torch.full((2,), float(rank + 1)))\n"
                    "g = torch.zeros(2)\ndist.all_gather_single(g, s)", display=False)
        assert res.ok, res
        got = [x.tolist() for x in c.pull("g")]
        assert got == [[3.0, 3.0], [3.0, 3.0]], f"reduce_scatter + all_gather gave {got}"
        print("reduce_scatter_single + all_gather_single: both ranks hold [3.0, 3.0]", flush=True)

        for strategy in args.strategies.split(","):
            c.run(SETUP, display=False)
            info = c.wrap("net", strategy, optimizer="adamw", lr=1e-2)
            c.set_data("ds", seed=1)
            s = c.train(steps=args.steps, micro_batch=8, progress=False)
            assert s is not None and s.steps == args.steps, s
            assert s.dp == 2 and s.global_batch == 16, s
            losses = list(s.losses)
            assert len(losses) == args.steps and all(math.isfinite(x) for x in losses), losses
            assert losses[-1] < losses[0], f"{strategy}: the loss did not go down: {losses}"
            verdict = c.check()
            assert verdict["ok"], f"{strategy}: replicas differ after training: {verdict}"
            print(f"{strategy}: {info['n_params']} parameters, {s.steps} steps, "
                  f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; {verdict['summary']}", flush=True)
    finally:
        stopped = c.stop()
    print(f"stopped ({len(stopped)} processes); {time.monotonic() - t0:.1f} s in all", flush=True)
    print("SMOKE PASSED", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AssertionError as e:
        print(f"SMOKE FAILED: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as e:  # a rank's traceback, not only the one-line summary
        print(getattr(e, "report", None) or repr(e), file=sys.stderr, flush=True)
        print(f"SMOKE FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)

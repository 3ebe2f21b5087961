"""Run dpnb's side-by-side benchmarks and print the table of ratios.

    python benchmarks/run.py                      # all of it, ~10 minutes on 2 cores
    python benchmarks/run.py --only roundtrip,train
    python benchmarks/run.py --smoke              # tiny sizes: proves each one still runs
    python benchmarks/run.py --write              # also put the table in benchmarks/RESULTS.md

Ratios are dpnb / baseline of medians taken in the same run, alternating
the sides, so they survive a machine that drifts; absolute times do not.
On a GPU machine the same command runs with NCCL (``--backend auto``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import suite  # noqa: E402

RESULTS = os.path.join(suite.HERE, "RESULTS.md")
BEGIN, END = "<!-- run.py:begin -->", "<!-- run.py:end -->"


def machine(ctx: suite.Context) -> dict:
    import torch

    import dpnb

    backend = ctx.cluster.backend if ctx.cluster is not None else ctx.backend
    return {"date": datetime.date.today().isoformat(), "cores": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "dpnb": dpnb.__version__, "backend": backend,
            "world_size": ctx.n, "gpus": torch.cuda.device_count()}


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def table(rows: list[suite.Row]) -> str:
    lines = ["| benchmark | metric | dpnb side | median (IQR %) | baseline | median (IQR %) | "
             "ratio (IQR) | target | met |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        met = {True: "yes", False: "**no**", None: ""}[r.met]
        extra = ""
        fl = r.extra.get("final_loss")
        if fl:
            extra = f" (final loss {fl['dpnb']:.4f} vs {fl['torchrun']:.4f})"
        if "efficiency" in r.extra:
            extra = f" (efficiency {r.extra['efficiency']:.2f})"
        q = r.ratio_iqr
        iqr = f" ({_fmt(q[0])}-{_fmt(q[1])})" if q else ""
        lines.append(
            f"| {r.bench} | {r.metric}{extra} | {r.a_label} | {_fmt(r.a['median'])} {r.unit} "
            f"({r.a['spread_pct']:.0f}) | {r.b_label} | {_fmt(r.b['median'])} {r.unit} "
            f"({r.b['spread_pct']:.0f}) | {_fmt(r.ratio)}{iqr} | {r.target} | {met} |")
    return "\n".join(lines)


def header(m: dict, took: float, argv: list[str]) -> str:
    return (f"{m['date']}, {m['cores']} cores ({m['cpu']}), {m['gpus']} GPUs, Python "
            f"{m['python']}, torch {m['torch']}, dpnb {m['dpnb']}, backend {m['backend']}, "
            f"world size {m['world_size']}; `python benchmarks/run.py{' ' if argv else ''}"
            f"{' '.join(argv)}` took {took:.0f} s.")


def write_results(text: str, path: str = RESULTS) -> None:
    """Replace the run.py section of RESULTS.md (or append one)."""
    block = f"{BEGIN}\n{text}\n{END}"
    old = open(path).read() if os.path.exists(path) else "# Results\n"
    if BEGIN in old and END in old:
        new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, old, flags=re.S)
    else:
        new = old.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(new)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(suite.BENCHES)}")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: checks it runs")
    p.add_argument("--rounds", type=int, default=2, help="A/B rounds per comparison (default 2)")
    p.add_argument("-n", type=int, default=2, help="world size (default 2)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--train-configs", default=None, metavar="M:S,...",
                   help="training rows for these model:strategy pairs only (e.g. mlp:ddp,tinylm:ddp)")
    p.add_argument("--json", default=None, help="write every row, with raw statistics, here")
    p.add_argument("--write", action="store_true", help="put the table into benchmarks/RESULTS.md")
    a = p.parse_args(argv)
    names = list(suite.BENCHES) if not a.only else [x.strip() for x in a.only.split(",") if x.strip()]
    unknown = [x for x in names if x not in suite.BENCHES]
    if unknown:
        p.error(f"unknown benchmark {unknown[0]!r}: choose from {', '.join(suite.BENCHES)}")
    configs = tuple(x.strip() for x in a.train_configs.split(",")) if a.train_configs else None
    bad = [x for x in configs or () if x.count(":") != 1 or x.split(":")[0] not in suite.MODELS
           or x.split(":")[1] not in suite.STRATEGIES]
    if bad:
        p.error(f"--train-configs: {bad[0]!r} is not model:strategy with model in "
                f"{', '.join(suite.MODELS)} and strategy in {', '.join(suite.STRATEGIES)}")
    ctx = suite.Context(smoke=a.smoke, rounds=max(1, a.rounds), n=a.n, backend=a.backend,
                        train_configs=configs)
    t_all = time.perf_counter()
    rows: list[suite.Row] = []
    failed: dict[str, str] = {}
    timings: dict[str, float] = {}
    try:
        for name in names:
            if name != "startup" and ctx.cluster is None:
                ctx.start_main()
            t0 = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                got = suite.BENCHES[name](ctx)
            except Exception:
                failed[name] = traceback.format_exc()
                print(failed[name], file=sys.stderr, flush=True)
                continue
            timings[name] = time.perf_counter() - t0
            rows += got
            print(table(got), flush=True)
            print(f"({timings[name]:.0f} s)", flush=True)
        m = machine(ctx)
    finally:
        ctx.stop_main()
    took = time.perf_counter() - t_all
    head = header(m, took, argv)
    text = head + "\n\n" + table(rows)
    print("\n" + text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": m, "took_s": took, "timings_s": timings, "failed": failed,
                       "rows": [r.as_dict() for r in rows]}, f, indent=1)
    if a.write and not failed:
        write_results(text)
        print(f"wrote {RESULTS}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

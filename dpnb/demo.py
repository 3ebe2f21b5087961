"""``dpnb demo``: the quick start, headless, with a report.

Runs what notebook 00 does on CPU engines without a browser: start a
cluster, run a cell on every rank, a real all_reduce, build a tiny
character-level language model and its data on every rank, wrap it, train
with live progress in the terminal, check the replicas, and render the views
(memory predicted vs measured, gradient-sync timeline, global batch, ring
all-reduce on the live ranks, communication benchmark) to PNG files and a
short ``index.html``.
"""

from __future__ import annotations

import contextlib
import html
import io
import os
import time

from .core.strategies import is_ddp
from .session import Cluster

MODEL_CELL = """
import dpnb.data
torch.manual_seed(0)
ds = dpnb.data.CharTextDataset(seq_len=32)
net = dpnb.data.TinyLM(ds.vocab_size, d_model=32, n_layers=2, n_heads=2, seq_len=32)
"""


def _text(fn, *args, **kw) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args, **kw)
    return buf.getvalue()


def _loss_png(losses: list[float], first_step: int, path: str) -> str:
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.5, 3.2), dpi=100)
    ax = fig.add_subplot()
    ax.plot(range(first_step, first_step + len(losses)), losses, marker="o", ms=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over the global batch)")
    ax.set_title("training loss, character-level TinyLM")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def run_demo(out_dir: str = "demo-out", *, n: int = 2, steps: int = 20,
             strategy: str = "ddp", log=print) -> str:
    """Run the quick start on ``n`` CPU engines; return the report's path."""
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    from .widgets import batch, comm, gradsync, memory, ring

    os.makedirs(out_dir, exist_ok=True)
    sections: list[tuple[str, str, str | None]] = []  # (title, text, png)
    t0 = time.monotonic()
    log(f"starting {n} engines...")
    c = Cluster.start(n, backend="gloo", timeout=30)
    try:
        r = c.run("print(f'rank {rank} of {world_size} on {device}')", display=False)
        sections.append(("Every rank runs the cell",
                         "\n".join(r.outcomes[k].stdout.strip() for k in r.ranks), None))
        r = c.run("t = torch.tensor([float(rank + 1)], device=device)\n"
                  "dist.all_reduce(t)\nprint(t.item())", display=False)
        total = sum(range(1, n + 1))
        got = {k: r.outcomes[k].stdout.strip() for k in r.ranks}
        held = sorted(set(got.values()))
        sections.append(("A real all_reduce", (
            f"each rank contributes rank+1; every rank now holds {held[0]} "
            f"(expected {float(total)})" if len(held) == 1 else
            f"each rank contributes rank+1; the ranks disagree (expected {float(total)}): "
            + ", ".join(f"rank {k} holds {v}" for k, v in sorted(got.items()))), None))

        c.run(MODEL_CELL, display=False)
        bucket = 0.05 if is_ddp(strategy) else None
        info = c.wrap("net", strategy, lr=3e-3, bucket_cap_mb=bucket)
        c.set_data("ds")
        log(f"training {info['n_params']:,}-parameter TinyLM with {strategy} for {steps} steps")
        s = c.train(steps=steps, micro_batch=8, grad_accum=2, seq_len=32)
        print()
        verdict = c.check()
        sections.append((
            f"Training with {strategy}",
            f"{s['steps']} steps, global batch {s['global_batch']} = micro-batch "
            f"{s['micro_batch']} x DP {s['dp']} x grad-accum {s['grad_accum']} "
            f"({s['global_batch'] * 32:,} tokens); loss {s['losses'][0]:.3f} -> {s['loss']:.3f}; "
            f"{s['samples_per_s']:.1f} samples/s\nreplica check: {verdict['summary']}",
            _loss_png(s["losses"], s["first_step"], os.path.join(out_dir, "loss.png"))))

        views = [
            ("ZeRO memory: exact prediction beside what each rank holds", memory, {}),
            ("Gradient sync: backward, buckets, all-reduce", gradsync, {"last": 1}),
            ("Global batch arithmetic (live values)", batch, {}),
        ]
        if not is_ddp(strategy):
            views = [v for v in views if v[1] is not gradsync]
        for title, mod, kw in views:
            name = mod.__name__.rsplit(".", 1)[1]
            png = mod.save(os.path.join(out_dir, f"{name}.png"), c, **kw)
            sections.append((title, _text(mod.show, c, **kw), png))
        png = ring.save(os.path.join(out_dir, "ring.png"), c, n=n, numel=1024)
        sections.append(("Ring all-reduce = reduce-scatter + all-gather, on the ranks",
                         _text(ring.show, c, n=n, numel=1024), png))
        b = comm.bench(c, comm.log_sizes(1e3, 4e6, 6), "all_reduce", 3)
        png = comm.save(os.path.join(out_dir, "comm.png"), link="gloo-loopback", n=n,
                        collectives=("all_reduce",), bench=b)
        sections.append(("all_reduce measured on the ranks vs the alpha-beta model", "", png))
    finally:
        c.stop()
    elapsed = time.monotonic() - t0
    return _write_report(out_dir, sections, n=n, strategy=strategy, elapsed=elapsed)


def _write_report(out_dir: str, sections, *, n: int, strategy: str, elapsed: float) -> str:
    parts = ["<!doctype html><meta charset='utf-8'><title>dpnb demo</title>",
             "<style>body{font-family:sans-serif;max-width:1000px;margin:2em auto}"
             "pre{background:#f6f6f6;padding:8px;overflow:auto}img{max-width:100%}</style>",
             f"<h1>dpnb quick start</h1><p>{n} CPU engines (gloo), strategy {strategy}, "
             f"{elapsed:.0f} s end to end.</p>"]
    for title, text, png in sections:
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if text:
            parts.append(f"<pre>{html.escape(text)}</pre>")
        if png:
            parts.append(f"<img src='{html.escape(os.path.basename(png))}' alt='{html.escape(title)}'>")
    path = os.path.join(out_dir, "index.html")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path

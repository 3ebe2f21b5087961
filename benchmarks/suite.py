"""dpnb measured side by side with what people use without it.

Each benchmark runs both sides in this process tree, alternating A B A B
after warm-ups, and returns rows of ``median``/``spread`` per side and the
ratio dpnb / baseline.  Nothing here asserts a speed: ``run.py`` prints the
table and writes ``RESULTS.md``; the smoke test only checks that every
benchmark ran.

The sides:

* cell round trip: ``%%dp`` vs ``DirectView.execute`` and ``%%px`` on the
  same engines;
* training step: ``%dp train`` vs ``plain_train.py`` under ``torchrun``
  (same model, data order, seed and steps; the final losses are compared);
* start-up: ``dpnb.start`` vs ``ipyparallel.Cluster.start_and_connect_sync``
  plus a hand-written ``init_process_group``; first and second training call
  vs ``accelerate.notebook_launcher``;
* all-reduce: ``%dp bench allreduce`` vs ``raw_allreduce.py`` under torchrun;
* instrumentation: ``%dp train`` with recording on vs ``--no-record``;
* scaling: samples/s at world size 1 and 2.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))

MODELS = ("mlp", "tinylm")
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


# --------------------------------------------------------------------------
# statistics and rows


def stats(xs: list[float]) -> dict:
    """Median, quartiles and min/max of ``xs``; ``spread`` is the IQR over the median."""
    xs = sorted(float(x) for x in xs)
    med = statistics.median(xs)
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {"median": med, "q1": q1, "q3": q3, "min": xs[0], "max": xs[-1], "n": len(xs),
            "spread_pct": 100.0 * (q3 - q1) / med if med else 0.0}


@dataclass
class Row:
    """One comparison: dpnb's side ``a`` against the baseline ``b``."""

    bench: str
    metric: str
    unit: str
    a_label: str
    a: dict
    b_label: str
    b: dict
    target: str = ""
    # "le": ratio <= limit is good; "ge": ratio >= limit is good
    sense: str = "le"
    limit: float | None = None
    extra: dict = field(default_factory=dict)
    # a_i / b_i for rounds run back to back: their median follows the
    # machine's drift far less than the ratio of the two overall medians
    paired: list | None = None

    @property
    def ratio(self) -> float | None:
        if self.paired:
            return statistics.median(self.paired)
        if not self.b["median"]:
            return None
        return self.a["median"] / self.b["median"]

    @property
    def ratio_iqr(self) -> tuple[float, float] | None:
        if not self.paired or len(self.paired) < 2:
            return None
        q = stats(self.paired)
        return q["q1"], q["q3"]

    @property
    def met(self) -> bool | None:
        r = self.ratio
        if self.limit is None or r is None:
            return None
        ok = r <= self.limit if self.sense == "le" else r >= self.limit
        for check in self.extra.get("also", []):
            ok = ok and bool(check["ok"])
        return ok

    def as_dict(self) -> dict:
        return {"bench": self.bench, "metric": self.metric, "unit": self.unit,
                "a_label": self.a_label, "a": self.a, "b_label": self.b_label, "b": self.b,
                "ratio": self.ratio, "ratio_iqr": self.ratio_iqr, "paired": self.paired,
                "target": self.target, "met": self.met, "extra": self.extra}


def alternate(sides: list[tuple[str, Callable[[], Any]]], rounds: int,
              warmup: int = 0) -> dict[str, list]:
    """Call each side in turn, ``warmup`` untimed rounds then ``rounds`` kept
    ones (A B A B ...), so drift on a shared machine hits both alike."""
    for _ in range(warmup):
        for _, fn in sides:
            fn()
    out: dict[str, list] = {label: [] for label, _ in sides}
    for _ in range(rounds):
        for label, fn in sides:
            out[label].append(fn())
    return out


def paired(a: list, b: list, key: Callable = lambda x: x) -> list[float]:
    """Per-round ratios ``key(a_i) / key(b_i)``."""
    return [key(x) / key(y) for x, y in zip(a, b) if key(y)]


def med(xs) -> float:
    return statistics.median(xs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet():
    """Swallow what magics print (the same for both sides)."""
    return contextlib.redirect_stdout(io.StringIO())


def torchrun_env() -> dict:
    # torchrun sets OMP_NUM_THREADS=1 itself for more than one worker, with a
    # warning; one thread per rank is also what dpnb gives its engines here.
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun_cmd(script: str, args: list[str], nproc: int) -> list[str]:
    """``benchmarks/script`` under this interpreter's torchrun, on loopback."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            os.path.join(HERE, script), *args]


def torchrun(script: str, args: list[str], nproc: int, timeout: float = 600) -> None:
    """Run ``benchmarks/script`` under torchrun to the end."""
    p = subprocess.run(torchrun_cmd(script, args, nproc), env=torchrun_env(),
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"{script} under torchrun failed ({p.returncode}):\n{p.stderr[-3000:]}")


@dataclass
class Context:
    """What the benchmarks share: sizes, the IPython shell, the main cluster."""

    smoke: bool
    rounds: int
    n: int = 2
    backend: str = "auto"
    #: ``model:strategy`` pairs for the training rows (None: every pair)
    train_configs: tuple | None = None
    shell: Any = None
    cluster: Any = None
    tmp: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="dpnb-bench-"))

    @property
    def tiny(self) -> bool:
        return self.smoke

    def start_main(self) -> None:
        """``%load_ext dpnb`` in an IPython shell and ``%dp start -n N``."""
        from IPython.core.interactiveshell import InteractiveShell

        import dpnb

        self.shell = InteractiveShell.instance()
        self.shell.run_line_magic("load_ext", "dpnb")
        with quiet():
            self.shell.run_line_magic("dp", f"start -n {self.n} --backend {self.backend}")
        self.cluster = dpnb.get_cluster(self.shell)

    def stop_main(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


SETUP_CELL = """
import sys
if {here!r} not in sys.path:
    sys.path.insert(0, {here!r})
import models
net, ds, mb = models.build({name!r}, tiny={tiny!r})
"""


def _setup(c, name: str, strategy: str, tiny: bool, shell=None) -> int:
    """Build ``net``/``ds`` on every rank and wrap it, as a user would."""
    c.run(SETUP_CELL.format(here=HERE, name=name, tiny=tiny), display=False)
    with quiet():
        if shell is not None:
            shell.run_line_magic("dp", f"wrap net --strategy {strategy}")
            shell.run_line_magic("dp", "data ds")
        else:
            c.wrap("net", strategy)
            c.set_data("ds")
    return int(c.pull("mb", rank=0))


# --------------------------------------------------------------------------
# 1. cell round trip


def bench_roundtrip(ctx: Context) -> list[Row]:
    """``%%dp`` against ipyparallel on the same engines, one cell at a time.

    Every side sends one execute request per engine and waits for every
    reply (``%%dp`` also waits for each engine's idle status so no late
    output is lost, and groups identical output).  Output is printed into a
    buffer on every side.
    """
    sh, c = ctx.shell, ctx.cluster
    view = c.client[[r.engine_id for r in c.ranks]]
    view.block = True
    view.activate()  # registers %%px for these engines
    rounds = 20 if ctx.smoke else 150
    printing = 'import os; print("hello from", os.getpid())'

    def timed(fn):
        def go():
            with quiet():
                t0 = time.perf_counter()
                fn()
                return time.perf_counter() - t0
        return go

    def raw_print():
        view.execute(printing).display_outputs()

    rows = []
    for what, code, raw in (("pass", "pass", lambda: view.execute("pass")),
                            ("print one line per rank", printing, raw_print)):
        res = alternate([
            ("%%dp", timed(lambda code=code: sh.run_cell_magic("dp", "", code))),
            ("execute", timed(raw)),
            ("%%px", timed(lambda code=code: sh.run_cell_magic("px", "--block", code))),
        ], rounds, warmup=5)
        ms = {k: stats([1e3 * x for x in v]) for k, v in res.items()}
        is_pass = what == "pass"
        also = [{"what": "%%dp pass median < 15 ms", "ok": ms["%%dp"]["median"] < 15.0}] \
            if is_pass else []
        rows.append(Row("cell round trip", f"`{what}` cell", "ms", "%%dp", ms["%%dp"],
                        "view.execute", ms["execute"],
                        target="<= 1.25 and < 15 ms" if is_pass else "", limit=1.25 if is_pass else None,
                        extra={"also": also}, paired=paired(res["%%dp"], res["execute"])))
        rows.append(Row("cell round trip", f"`{what}` cell", "ms", "%%dp", ms["%%dp"],
                        "%%px", ms["%%px"], paired=paired(res["%%dp"], res["%%px"])))
    return rows


# --------------------------------------------------------------------------
# 2. training step


class PlainServer:
    """``plain_train.py --serve`` under torchrun, driven over FIFOs.

    Both ranks block reading their command FIFO between blocks (no CPU
    used), so the two sides can alternate block by block while each keeps
    its model, optimizer and data position.
    """

    def __init__(self, ctx: Context):
        self.dir = tempfile.mkdtemp(prefix="serve-", dir=ctx.tmp)
        self.n = ctx.n
        for r in range(self.n):
            os.mkfifo(os.path.join(self.dir, f"cmd-{r}"))
        os.mkfifo(os.path.join(self.dir, "resp"))
        cmd = torchrun_cmd("plain_train.py", ["--serve", self.dir, "--backend", ctx.cluster.backend]
                           + (["--tiny"] if ctx.tiny else []), self.n)
        self.log = open(os.path.join(self.dir, "log"), "w+")
        self.proc = subprocess.Popen(cmd, env=torchrun_env(), stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.cmds = [self._open_write(os.path.join(self.dir, f"cmd-{r}")) for r in range(self.n)]
        self.resp = os.fdopen(os.open(os.path.join(self.dir, "resp"), os.O_RDONLY | os.O_NONBLOCK))
        self._buf = ""

    def _dead(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return f"plain_train.py under torchrun exited ({self.proc.poll()}):\n{self.log.read()[-3000:]}"

    def _open_write(self, path: str, timeout: float = 120.0):
        t0 = time.monotonic()
        while True:
            try:
                return os.fdopen(os.open(path, os.O_WRONLY | os.O_NONBLOCK), "w")
            except OSError:  # ENXIO: the rank has not opened its end yet
                if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                    raise RuntimeError(self._dead()) from None
                time.sleep(0.05)

    def ask(self, cmd: dict, timeout: float = 600.0) -> dict:
        import select

        for f in self.cmds:
            f.write(json.dumps(cmd) + "\n")
            f.flush()
        t0 = time.monotonic()
        while "\n" not in self._buf:
            ready, _, _ = select.select([self.resp], [], [], 0.5)
            if ready:
                chunk = os.read(self.resp.fileno(), 1 << 20).decode()
                self._buf += chunk
                if chunk:
                    continue
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError(self._dead())
        line, self._buf = self._buf.split("\n", 1)
        return json.loads(line)

    def close(self) -> None:
        try:
            for f in self.cmds:
                f.write(json.dumps({"op": "quit"}) + "\n")
                f.close()
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        finally:
            self.resp.close()
            self.log.close()


def bench_train(ctx: Context) -> list[Row]:
    """``%dp train`` (recording on, as users run it) against the same loop
    under torchrun, alternating blocks of steps on both live jobs.

    Step time is the median of per-step times (both sides time data loading
    through the optimizer step).  samples/s divides a block's samples by its
    wall time as each side's user sees it: the whole ``%dp train`` call for
    dpnb, the loop after a barrier for torchrun.  The final losses of the
    two sides must agree: it is the same training.
    """
    import dpnb.session.verbs

    sh, c = ctx.shell, ctx.cluster
    configs = ([tuple(pair.split(":")) for pair in ctx.train_configs] if ctx.train_configs
               else [(m, s) for m in MODELS for s in STRATEGIES])
    warmup, steps, rounds = (1, 2, 1) if ctx.smoke else (5, 5, 10 * ctx.rounds)
    plain = PlainServer(ctx)
    rows = []
    try:
        for name, strategy in configs:
            mb = _setup(c, name, strategy, ctx.tiny, shell=sh)
            plain.ask({"op": "setup", "config": f"{name}:{strategy}"})

            def ours(n=steps, mb=mb):
                with quiet():
                    t0 = time.perf_counter()
                    sh.run_line_magic("dp", f"train --steps {n} --micro-batch {mb}")
                    wall = time.perf_counter() - t0
                s = c.training.last_train.summary
                recs = dpnb.session.verbs.records(c, last=n)[0]
                return {"step_times_s": [r["step_time_s"] for r in recs], "wall_s": wall,
                        "samples": s["global_batch"] * n, "final_loss": s["loss"]}

            def theirs(n=steps):
                r = plain.ask({"op": "steps", "n": n})
                return {"step_times_s": r["step_times_s"], "wall_s": r["loop_wall_s"],
                        "samples": r["micro_batch"] * r["world_size"] * n,
                        "final_loss": r["final_loss"]}

            ours(warmup)
            theirs(warmup)
            res = alternate([("dpnb", ours), ("torchrun", theirs)], rounds)
            a = [x for r in res["dpnb"] for x in r["step_times_s"]]
            b = [x for r in res["torchrun"] for x in r["step_times_s"]]
            la, lb = res["dpnb"][-1]["final_loss"], res["torchrun"][-1]["final_loss"]
            same = abs(la - lb) <= 1e-4 * max(1.0, abs(lb))
            rows.append(Row("training step", f"{name} {strategy} step time", "ms", "%dp train",
                            stats([1e3 * x for x in a]), "torchrun", stats([1e3 * x for x in b]),
                            target="<= 1.03", limit=1.03,
                            extra={"final_loss": {"dpnb": la, "torchrun": lb, "same": same},
                                   "also": [{"what": "same final loss", "ok": same}]},
                            paired=paired(res["dpnb"], res["torchrun"],
                                          lambda r: med(r["step_times_s"]))))
            rows.append(Row("training step", f"{name} {strategy} samples/s (whole call)",
                            "samples/s", "%dp train",
                            stats([r["samples"] / r["wall_s"] for r in res["dpnb"]]), "torchrun",
                            stats([r["samples"] / r["wall_s"] for r in res["torchrun"]]),
                            paired=paired(res["dpnb"], res["torchrun"],
                                          lambda r: r["samples"] / r["wall_s"])))
    finally:
        plain.close()
    return rows


# --------------------------------------------------------------------------
# 3. start-up


INIT_CELL = """
import datetime, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=30))
_t = torch.ones(1)
dist.all_reduce(_t)
"""


def _raw_start(n: int) -> float:
    """ipyparallel's own start plus the process group by hand; seconds to ready."""
    import ipyparallel as ipp

    log = logging.getLogger("dpnb-bench.ipp")
    log.setLevel(logging.ERROR)
    prof = tempfile.mkdtemp(prefix="dpnb-bench-ipp-")
    t0 = time.perf_counter()
    cl = ipp.Cluster(n=n, profile_dir=prof, controller_ip="127.0.0.1", log=log)
    rc = cl.start_and_connect_sync(n=n)
    try:
        eids = sorted(rc.ids)[:n]
        port = free_port()
        for r, e in enumerate(eids):
            rc[e].push({"rank": r, "world": n, "port": port}, block=False)
        rc[eids].execute(INIT_CELL, block=True)
        dt = time.perf_counter() - t0
    finally:
        rc.close()
        cl.stop_cluster_sync()
    return dt


def _dpnb_start(ctx: Context, name: str, warm: bool = False) -> dict:
    """``dpnb.start`` to a ready group; then the first training step; then a
    second ``train`` call on the live state.  ``warm``: as in a notebook
    after ``%load_ext dpnb``, whose zygote imported torch while the user
    wrote the next cell (as ``notebook_launcher`` forks a notebook process
    that imported torch in an earlier cell)."""
    import dpnb
    from dpnb.cluster.zygote import WarmZygote

    zyg = None
    if warm:
        zyg = WarmZygote()
        zyg.wait_ready()
    t0 = time.perf_counter()
    try:
        c = dpnb.start(ctx.n, backend=ctx.backend, warm=zyg)
        t_ready = time.perf_counter() - t0
    finally:
        if zyg is not None:  # the kernel's template outlives its clusters; this one is done
            zyg.close()
    try:
        mb = _setup(c, name, "ddp", ctx.tiny)
        c.train(steps=1, micro_batch=mb, progress=False)
        t_first = time.perf_counter() - t0
        t1 = time.perf_counter()
        c.train(steps=1, micro_batch=mb, progress=False)
        t_second = time.perf_counter() - t1
    finally:
        c.stop()
    return {"ready": t_ready, "first": t_first, "second": t_second}


def _launcher(ctx: Context, name: str) -> dict:
    """Two ``notebook_launcher`` calls of the same training function."""
    from accelerate import notebook_launcher

    import accel_train

    out = os.path.join(ctx.tmp, "accel.json")
    res = {}
    for key in ("first", "second"):
        if os.path.exists(out):
            os.remove(out)
        t0 = time.time()
        with quiet():
            notebook_launcher(accel_train.train, args=(name, ctx.tiny, out), num_processes=ctx.n)
        with open(out) as f:
            res[key] = json.load(f)["t_first_step"] - t0
    return res


def bench_startup(ctx: Context) -> list[Row]:
    """Start-up to a ready process group, and time to the first training step.

    Runs before the main cluster exists, so nothing else is running.
    """
    name = "tinylm"
    rounds = 1 if ctx.smoke else ctx.rounds
    sys.path.insert(0, HERE)
    try:
        import accelerate  # noqa: F401
        have_accel = True
    except ImportError:
        have_accel = False
    sides = [("dpnb", lambda: _dpnb_start(ctx, name)), ("raw", lambda: _raw_start(ctx.n)),
             ("dpnb warm", lambda: _dpnb_start(ctx, name, warm=True))]
    if have_accel:
        sides.append(("launcher", lambda: _launcher(ctx, name)))
    res = alternate(sides, rounds)
    dp = res["dpnb"]
    rows = [Row("start-up", f"{ctx.n} engines to a ready process group", "s", "dpnb.start",
                stats([r["ready"] for r in dp]), "ipyparallel + manual init",
                stats(res["raw"]), target="<= 1.1", limit=1.1,
                paired=paired([r["ready"] for r in dp], res["raw"]))]
    if have_accel:
        la = res["launcher"]
        rows.append(Row("start-up", f"first call to first step ({name}, ddp)", "s",
                        "dpnb start+wrap+train", stats([r["first"] for r in dp]),
                        "notebook_launcher", stats([r["first"] for r in la]),
                        paired=paired(dp, la, lambda r: r["first"])))
        dw = res["dpnb warm"]
        rows.append(Row("start-up", f"first call to first step, after %load_ext ({name}, ddp)",
                        "s", "dpnb start+wrap+train", stats([r["first"] for r in dw]),
                        "notebook_launcher", stats([r["first"] for r in la]), target="<= 1",
                        limit=1.0, paired=paired(dw, la, lambda r: r["first"])))
        rows.append(Row("start-up", "second call to first step", "s", "%dp train",
                        stats([r["second"] for r in dp]), "notebook_launcher",
                        stats([r["second"] for r in la]), target="<= 0.1 (10x faster)",
                        limit=0.1, paired=paired(dp, la, lambda r: r["second"])))
    return rows


# --------------------------------------------------------------------------
# 4. all-reduce bandwidth


def _busbw(size: int, t: float, n: int) -> float:
    return 2 * (n - 1) / n * size / t / 1e9


def bench_allreduce(ctx: Context) -> list[Row]:
    """``%dp bench allreduce`` against a raw all-reduce loop under torchrun,
    same sizes.  busbw = algbw x 2(N-1)/N (the nccl-tests convention)."""
    sh, n = ctx.shell, ctx.n
    sizes = [1024 * 4 ** k for k in range(9)]  # 1 KiB .. 64 MiB
    iters = 20
    if ctx.smoke:
        sizes, iters = [1024, 1 << 20], 2
    rounds = 1 if ctx.smoke else 2 * ctx.rounds
    path = os.path.join(ctx.tmp, "raw_allreduce.json")

    def ours():
        with quiet():
            b = sh.run_line_magic(
                "dp", f"bench allreduce --sizes {sizes[0]}:{sizes[-1]}:{len(sizes)} --iters {iters}")
        return dict(zip(b.sizes, b.times_s))

    def raw():
        torchrun("raw_allreduce.py", ["--sizes", ",".join(map(str, sizes)), "--iters", str(iters),
                                      "--backend", ctx.cluster.backend, "--out", path], n)
        with open(path) as f:
            d = json.load(f)
        return dict(zip(d["sizes"], d["times_s"]))

    res = alternate([("dpnb", ours), ("raw", raw)], rounds)
    rows = []
    for s in sizes:
        a = [_busbw(s, r[s], n) for r in res["dpnb"]]
        b = [_busbw(s, r[s], n) for r in res["raw"]]
        big = s >= 1 << 20
        rows.append(Row("all-reduce busbw", _size(s), "GB/s", "%dp bench", stats(a),
                        "raw torch.distributed", stats(b), sense="ge",
                        target=">= 0.95" if big else "", limit=0.95 if big else None,
                        paired=paired(a, b)))
    return rows


def _size(s: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if s >= k:
            return f"{s / k:g} {unit}"
    return f"{s} B"


# --------------------------------------------------------------------------
# 5. instrumentation overhead


def bench_instrumentation(ctx: Context) -> list[Row]:
    """Step time with recording on (bucket timelines, per-step bytes) vs off,
    alternating blocks of steps on the same wrapped model."""
    import dpnb.session.verbs

    sh, c = ctx.shell, ctx.cluster
    steps = 2 if ctx.smoke else 8
    rounds = 1 if ctx.smoke else 4 * ctx.rounds
    rows = []
    for strategy in ("ddp", "zero2"):
        mb = _setup(c, "tinylm", strategy, ctx.tiny, shell=sh)

        def block(flag):
            def go():
                with quiet():
                    sh.run_line_magic("dp", f"train --steps {steps} --micro-batch {mb} {flag}")
                return [r["step_time_s"] for r in dpnb.session.verbs.records(c, last=steps)[0]]
            return go

        res = alternate([("on", block("")), ("off", block("--no-record"))], rounds, warmup=1)
        rows.append(Row("instrumentation", f"tinylm {strategy} step time", "ms", "recording on",
                        stats([1e3 * x for r in res["on"] for x in r]), "off",
                        stats([1e3 * x for r in res["off"] for x in r]),
                        target="<= 1.05", limit=1.05,
                        paired=paired(res["on"], res["off"], med)))
    return rows


# --------------------------------------------------------------------------
# 6. scaling


def bench_scaling(ctx: Context) -> list[Row]:
    """Samples/s of the compute-bound MLP (DDP, one thread per rank) with one
    rank and with ``n`` ranks, micro-batch fixed per rank (weak scaling).
    Efficiency = throughput(n) / (n x throughput(1))."""
    import dpnb
    import dpnb.session.verbs

    big = ctx.cluster
    steps = 2 if ctx.smoke else 15
    rounds = 1 if ctx.smoke else 2 * ctx.rounds
    one = dpnb.start(1, threads=1, backend=ctx.backend)
    try:
        mbs = {c: _setup(c, "mlp", "ddp", ctx.tiny) for c in (one, big)}

        def block(c):
            def go():
                s = c.train(steps=steps, micro_batch=mbs[c], progress=False)
                return [s["global_batch"] / r["step_time_s"]
                        for r in dpnb.session.verbs.records(c, last=steps)[0]]
            return go

        for c in (one, big):
            block(c)()
        res = alternate([("n", block(big)), ("1", block(one))], rounds)
    finally:
        one.stop()
    a = stats([x for r in res["n"] for x in r])
    b = stats([x for r in res["1"] for x in r])
    row = Row("scaling", f"mlp ddp samples/s, {ctx.n} ranks vs 1", "samples/s",
              f"{ctx.n} ranks", a, "1 rank", b)
    row.extra["efficiency"] = a["median"] / (ctx.n * b["median"])
    return [row]


BENCHES: dict[str, Callable[[Context], list[Row]]] = {
    "startup": bench_startup,
    "roundtrip": bench_roundtrip,
    "train": bench_train,
    "allreduce": bench_allreduce,
    "instrumentation": bench_instrumentation,
    "scaling": bench_scaling,
}

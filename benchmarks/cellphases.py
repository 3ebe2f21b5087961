"""Where a dpnb cell's time goes, against ipyparallel on the same engines.

    python benchmarks/cellphases.py -n 8 [--cells 20] [--code "pass"]

One dpnb cluster of N ranks.  Calls alternate, K each: dpnb's ``run``,
ipyparallel's silent ``execute(code).get()`` (what ``benchmarks/scale.py``
calls raw), not silent, and the %%px way (not silent, then every engine's
idle status) -- all to the same engines, so only the notebook's and the
kernel's handling differ.  For dpnb's calls each phase is timed from the
start of ``run``: the cell sent to every rank, the first and last reply, the
last engine's idle status (callbacks on each rank's reply and output
futures), the wait's return.  Medians; ratios are medians of per-call ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--cells", type=int, default=20)
    ap.add_argument("--code", default="pass")
    a = ap.parse_args()
    import dpnb
    from dpnb.cluster import transport as T

    c = dpnb.start(a.n, threads=1)
    rec: list[dict] = []
    execute, wait = T.Transport.execute, T.Transport.wait

    def timed_execute(self, code, sel, unchecked=False):
        cur = {"t0": time.perf_counter(), "reply": {}, "idle": {}}
        ars = execute(self, code, sel, unchecked)
        cur["sent"] = time.perf_counter()
        for r, ar in ars.items():
            ar.add_done_callback(lambda f, r=r: cur["reply"].__setitem__(r, time.perf_counter()))
            ar._output_future.add_done_callback(
                lambda f, r=r: cur["idle"].__setitem__(r, time.perf_counter()))
        rec.append(cur)
        return ars

    def timed_wait(self, *args, **kwargs):
        res = wait(self, *args, **kwargs)
        rec[-1]["waited"] = time.perf_counter()
        return res

    T.Transport.execute, T.Transport.wait = timed_execute, timed_wait
    dv = c.transport.client[[r.engine_id for r in c.ranks]]

    def px() -> None:
        ar = dv.execute(a.code, silent=False, block=False)
        ar.get()
        ar.wait_for_output(5)

    calls = {"dpnb": lambda: c.run(a.code, display=False),
             "raw silent": lambda: dv.execute(a.code).get(),
             "raw not silent": lambda: dv.execute(a.code, silent=False).get(),
             "%%px way": px}
    t: dict = {k: [] for k in calls}
    try:
        for i in range(a.cells + 3):  # three untimed rounds first
            for k in (list(calls) if i % 2 == 0 else list(calls)[::-1]):
                s = time.perf_counter()
                calls[k]()
                if i >= 3:
                    t[k].append(time.perf_counter() - s)
        del rec[:len(rec) - a.cells]
    finally:
        c.stop()
    ms = lambda x: f"{x * 1e3:.1f} ms"  # noqa: E731
    print(f"N={a.n}, {a.code!r}, {a.cells} calls each: " + ", ".join(
        f"{k} {ms(statistics.median(v))} ({statistics.median(x / y for x, y in zip(t['dpnb'], v)):.3f})"
        for k, v in t.items()) + "  (dpnb / that, in brackets)")
    phase = lambda f: ms(statistics.median(f(x) for x in rec))  # noqa: E731
    print("dpnb, from the start of run: sent", phase(lambda x: x["sent"] - x["t0"]),
          "| first reply", phase(lambda x: min(x["reply"].values()) - x["t0"]),
          "| last reply", phase(lambda x: max(x["reply"].values()) - x["t0"]),
          "| last idle", phase(lambda x: max(x["idle"].values()) - x["t0"]),
          "| wait returned", phase(lambda x: x["waited"] - x["t0"]))
    print("idle after its reply, per engine: median", phase(
        lambda x: statistics.median(x["idle"][r] - x["reply"][r] for r in x["reply"])),
        "max", phase(lambda x: max(x["idle"][r] - x["reply"][r] for r in x["reply"])))


if __name__ == "__main__":
    main()

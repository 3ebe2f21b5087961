"""Recorded view data: what the engines return, written out, for the view
tests and for looking at the views at 32 ranks (unit tier, browser tier).

Two ranks' worth of DDP timeline from a 3-layer model (``ddp_record``), and
32-rank sets with one odd rank each: a straggler (gradsync, stragglers), a
rank holding 64 B more (memory), a dead rank (status, dashboard)."""

from dpnb.core import ParamSpec, exact_rank_bytes

PARAMS = {"0.weight": 4000, "0.bias": 40, "1.weight": 8000, "1.bias": 80, "2.weight": 2000, "2.bias": 20}
CAP_MB = 0.005  # 5,242 bytes: buckets [2.*, 1.*] = 10,100 B and [0.*] = 4,040 B


def ddp_record(rank, shift=0.0, b0_start=0.0045):
    t = lambda x: x + shift  # noqa: E731
    return {
        "rank": rank, "world_size": 2, "step": 5, "strategy": "ddp", "bucket_cap_mb": CAP_MB, "device": "cpu",
        "step_time_s": 0.009, "compute_s": 0.004, "compute_s_all": [0.004, 0.004], "straggle_delay_s": 0.0,
        "grad_accum": 1,
        "forward": [{"start": t(0.0), "end": t(0.0008)}],
        "backward": {"start": t(0.001), "compute_end": t(0.005), "returned": t(0.0072), "intervals": [
            {"module": "2", "start": t(0.001), "end": t(0.002), "params": ["2.bias", "2.weight"]},
            {"module": "1", "start": t(0.002), "end": t(0.004), "params": ["1.bias", "1.weight"]},
            {"module": "0", "start": t(0.004), "end": t(0.005), "params": ["0.bias", "0.weight"]}]},
        "buckets": [
            {"index": 0, "numel": 2525, "bytes": 10100, "params": ["2.bias", "2.weight", "1.bias", "1.weight"],
             "start": t(b0_start), "end": t(0.0061)},
            {"index": 1, "numel": 1010, "bytes": 4040, "params": ["0.bias", "0.weight"],
             "start": t(0.0051), "end": t(0.0071)}],
        "optimizer": {"start": t(0.0075), "end": t(0.0085)},
        "collectives": [], "watched": True,
        "param_bytes": dict(PARAMS), "param_order": list(PARAMS),
    }


def records32(slow=17):
    """Every rank's gradsync record at 32 ranks; rank ``slow`` straggles."""
    out = []
    for r in range(32):
        rec = ddp_record(r, shift=0.00001 * r)
        rec["world_size"] = 32
        rec["compute_s_all"] = [0.004] * 32
        if r == slow:  # a straggler: its step and its last bucket end later
            rec["step_time_s"] = 0.02
            rec["buckets"][1]["end"] += 0.004
        out.append(rec)
    return out


SPECS = [["0.weight", [7, 5], "float32", True], ["0.bias", [7], "float32", True],
         ["2.weight", [3, 7], "float32", True], ["2.bias", [3], "float32", True]]


def snapshots32(strategy, leak_rank=None):
    """Every rank's memory snapshot at 32 ranks, measured = exact prediction,
    but ``leak_rank`` holds 64 B more gradient storage."""
    specs = [ParamSpec(n, tuple(s), d, r) for n, s, d, r in SPECS]
    pred = exact_rank_bytes(specs, 32, strategy, "adamw", gradient_as_bucket_view=True)
    return [{"rank": p.rank, "world_size": 32, "strategy": strategy, "optimizer": "adamw", "mixed_precision": "none",
             "gradient_as_bucket_view": True, "specs": SPECS, "n_params": 66, "phase": "after_step", "step": 3,
             "measured": {"params": p.params, "grads": p.grad_storage + (64 if p.rank == leak_rank else 0),
                          "optimizer": p.optimizer_state}} for p in pred]


def status32(dead=(13,)):
    """``%dp status`` rows of 32 ranks on two hosts, ``dead`` killed."""
    return [{"rank": r, "host": f"node{r // 16}", "pid": 100 + r, "engine_id": r, "device": "cpu",
             "backend": "gloo", "alive": r not in dead,
             "state": "dead: killed by signal 9" if r in dead else "ok", "group": True,
             "rss_bytes": (400 + r) * 2**20, "cuda_allocated": None} for r in range(32)]


def stragglers32(slow: int = 23, steps: int = 5) -> list[dict]:
    """Rank 0's step records at 32 ranks: every rank's compute time, ``slow`` 30 ms late."""
    out = []
    for s in range(steps):
        comp = [0.02 + 0.0001 * r for r in range(32)]
        comp[slow] += 0.03
        out.append({"step": s, "rank": 0, "compute_s_all": comp, "step_time_s": max(comp) + 0.003})
    return out

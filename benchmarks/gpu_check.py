"""The GPU check of issue 38: what only real NCCL can show, in one command.

    python benchmarks/gpu_check.py [--out gpu-check-out]

Run it first on a GPU machine, before other GPU work (about 2 minutes on one
GPU; at most 10).  World size 1 over NCCL, one part at a time, each ending
in ``ok``, ``FAIL`` or ``skipped`` with a one-line reason:

* **A** a forced release (the side door's abort) of a cell's own DDP, a
  re-formation, then ``ddp.process_group is dist.group.WORLD`` by identity;
* **B** the optimizer-step gate after torch's watchdog aborted the group: a
  1 s group timeout, an all-reduce queued behind ~5 s of matmuls -- the
  watchdog times it out and aborts the communicator; the gate must refuse;
* **C** a rank in ``torch.cuda.synchronize()`` behind plain matmuls is
  reported running (no collective), and behind an all-reduce queued after
  them as in a device wait (the deadlock rule's input), asked while it waits;
* **E** ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` in dpnb's private folder and
  ``TORCH_NCCL_ENABLE_MONITORING`` as dpnb sets it, read on the engine;
* **F** ``c.pull`` of a CUDA tensor arrives as a CPU tensor;
* **two GPUs**: ``tests/gpu/test_multi_gpu.py`` when the machine has two,
  else skipped with the count.

Without a CUDA GPU it prints one line saying so and exits 0.  Writes
``summary.json`` and ``summary.txt`` (lines to paste into RESULTS.md) under
``--out``; exits 1 if a part failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: a cell's matmul loop lasting about ``secs`` seconds on this GPU (calibrated on the engine)
_BUSY = """
a = torch.randn(16384, 16384, device=device) / 128  # ~0.1 s a matmul: few launches, no full queue
torch.cuda.synchronize(); _t = time.perf_counter()
for _ in range(3):
    a = torch.tanh(a @ a)
torch.cuda.synchronize(); _per = (time.perf_counter() - _t) / 3
def busy(secs):
    global a
    for _ in range(max(1, int(secs / _per))):
        a = torch.tanh(a @ a)
"""


def _part_a(c) -> tuple[str, str]:
    c.run("import torch.nn as nn\n"
          "ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2).to(device), "
          "device_ids=[device.index])\n"
          "ddp(torch.ones(3, 4, device=device)).sum().backward()", display=False)
    released = c.transport.release([0])
    out = c.reform()
    res = c.run("print(ddp.process_group is dist.group.WORLD)\n"
                "ddp(torch.ones(3, 4, device=device)).sum().backward(); torch.cuda.synchronize()",
                display=False)
    same = res.stdout[0].strip() == "True"
    ok = released and not out["problems"] and same
    return ("ok" if ok else "FAIL",
            f"released={released}, re-form problems={out['problems']}, "
            f"ddp.process_group is WORLD={same}, a backward after it ran")


def _part_b(c) -> tuple[str, str]:
    res = c.run(
        "import time\nfrom dpnb import compat\nfrom dpnb.engine.train import step\n"
        "from dpnb.engine.train.train_state import TrainError\n" + _BUSY +
        "compat.set_group_timeout(1.0)\n"
        "busy(5.0)\n"
        "x = torch.ones(1, device=device); dist.all_reduce(x)\n"
        "try:\n"
        "    step.optimizer_gate(_dpnb, _dpnb.releases, device)\n"
        "    print('passed', compat.group_error())\n"
        "except TrainError as e:\n"
        "    print('refused', compat.group_error())\n", display=False)
    verdict, err = (res.stdout[0].split() + ["?", "?"])[:2]
    c.reform()  # the aborted group is of no further use
    if err in ("None", "?"):
        return ("skipped", f"the watchdog did not abort the group at world size 1 "
                           f"(gate {verdict}, group error {err}): B is not provoked here")
    return ("ok" if verdict == "refused" else "FAIL",
            f"watchdog error {err}; the gate {verdict} the step")


def _where_during(c, code: str, after_s: float) -> dict | None:
    """Run ``code`` on rank 0 and ask its side door where it is ``after_s`` in."""
    done: dict = {}
    t = threading.Thread(target=lambda: done.update(res=c.run(code, display=False)))
    t.start()
    time.sleep(after_s)
    ans = c.transport.where([0]).get(0)
    t.join()
    return ans


def _part_c(c) -> tuple[str, str]:
    from dpnb.cluster import deadlock

    c.run("import time\n" + _BUSY + "x = torch.ones(1, device=device); dist.all_reduce(x)\n"
          "x.item()", display=False)  # a collective completed before: only compute follows
    compute = _where_during(c, "busy(8.0)\ntorch.cuda.synchronize()", 4.0)
    queued = _where_during(c, "busy(8.0)\ndist.all_reduce(x)\ntorch.cuda.synchronize()", 4.0)
    run_ok = compute is not None and compute.get("collective") is None \
        and deadlock.certain({0: compute}, {0}, 2) == {}
    wait_ok = queued is not None and (queued.get("collective") or {}).get("device_wait") is True
    return ("ok" if run_ok and wait_ok else "FAIL",
            f"behind compute: collective={None if compute is None else compute.get('collective')}"
            f", top={None if compute is None else compute.get('top')}; behind a queued "
            f"all_reduce: collective={None if queued is None else queued.get('collective')}")


def _part_e(c) -> tuple[str, str]:
    res = c.run("import os\nfrom dpnb.engine.proc.private import private_dir\n"
                "print(os.environ.get('TORCH_NCCL_DEBUG_INFO_TEMP_FILE'), "
                "os.environ.get('TORCH_NCCL_ENABLE_MONITORING'), private_dir())", display=False)
    trace, monitoring, private = res.stdout[0].split()
    ok = trace.startswith(private.rstrip("/") + "/") and monitoring == "0"
    return ("ok" if ok else "FAIL",
            f"TORCH_NCCL_DEBUG_INFO_TEMP_FILE={trace} (private folder {private}), "
            f"TORCH_NCCL_ENABLE_MONITORING={monitoring}")


def _part_f(c) -> tuple[str, str]:
    import torch

    c.run("t = torch.arange(4.0, device=device)", display=False)
    t = c.pull("t", 0)
    ok = isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.tolist() == [0, 1, 2, 3]
    return ("ok" if ok else "FAIL", f"pulled {type(t).__name__} on {getattr(t, 'device', '?')}")


def _two_gpus(n: int) -> tuple[str, str]:
    if n < 2:
        return ("skipped", f"this machine has {n} GPU(s); NCCL refuses two ranks on one GPU")
    # a bound to prove "not hung", not a measurement: the tier takes about a minute
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/gpu/test_multi_gpu.py"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    last = (p.stdout.strip().splitlines() or ["(no output)"])[-1]
    return ("ok" if p.returncode == 0 else "FAIL", f"tests/gpu/test_multi_gpu.py: {last}")


PARTS = (("A", "forced release at world size 1, DDP rebound by identity", _part_a),
         ("B", "optimizer-step gate after the watchdog's abort", _part_b),
         ("C", "synchronize behind compute is running, behind a collective a wait", _part_c),
         ("E", "NCCL dump file and heartbeat monitor as dpnb sets them", _part_e),
         ("F", "c.pull of a CUDA tensor is a CPU tensor", _part_f))


def _write(out: str, rows: list[dict], head: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"head": head, "parts": rows}, f, indent=1)
    lines = [head] + [f"- {r['part']} ({r['what']}): {r['result']} -- {r['detail']}" for r in rows]
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-check-out")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA GPU on this machine (torch.cuda.is_available() "
              "is False)")
        return 0
    import dpnb

    n = torch.cuda.device_count()
    head = (f"gpu_check on {torch.cuda.get_device_name(0)} x{n}, torch {torch.__version__}, "
            f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
            f"{time.strftime('%Y-%m-%d')}")
    rows = []
    c = dpnb.start(1, backend="nccl", timeout=20)
    try:
        for name, what, fn in PARTS:
            t0 = time.monotonic()
            try:
                result, detail = fn(c)
            except Exception as e:  # a part that raised: reported, the others still run
                result, detail = "FAIL", f"{type(e).__name__}: {e}"[:300]
                try:
                    c.reform()
                except Exception as e2:  # noqa: BLE001 -- said in the row, the next part tries
                    detail += f"; re-form after it: {type(e2).__name__}: {e2}"[:200]
            rows.append({"part": name, "what": what, "result": result, "detail": detail,
                         "s": round(time.monotonic() - t0, 1)})
    finally:
        c.stop()
    result, detail = _two_gpus(n)
    rows.append({"part": "two GPUs", "what": "release, gate and rebinding across 2 ranks",
                 "result": result, "detail": detail, "s": None})
    _write(args.out, rows, head)
    return 1 if any(r["result"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

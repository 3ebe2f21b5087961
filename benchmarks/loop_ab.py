"""dpnb's training loop against another revision's, in the same engine, interleaved.

    python benchmarks/loop_ab.py --old REV [--backend auto|gloo|nccl] [--rounds 15]
                                 [--steps 20] [--warm 10] [--tiny]

Separate benchmark processes on a lent GPU machine drifted too much to
compare two versions of the loop (torchrun's own MLP step read 2.62 to
4.44 ms across four runs in one call there): this puts both in one engine.
The loop of ``REV`` -- ``dpnb/engine/train/step.py`` (one step) and
``dpnb/engine/train/call.py`` (one call), by ``git show`` -- is loaded beside
the current one as ``dpnb.engine.train._step_at_rev`` and ``_call_at_rev``
(its call module made to use its own step module; both import this
checkout's other engine modules, so they must still fit them: a revision
from before the engine's rooms does not) -- and, for the MLP and the
course's TinyLM under DDP on a 1-rank cluster, rounds alternate 20 steps of
the other loop's ``train`` and 20 of the current one on the same wrapped
model.  Prints each side's median step time and their ratio (current /
``REV``).  A GPU's host-bound steps are where the loop's own Python shows.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

CELL = """
import importlib.util as _iu, statistics as _stat, collections as _co, sys as _sys, types as _ty
_spec = _iu.spec_from_file_location("dpnb.engine.train._step_at_rev", {step!r})
_sys.modules[_spec.name] = _iu.module_from_spec(_spec)
_spec.loader.exec_module(_sys.modules[_spec.name])
_call = _ty.ModuleType("dpnb.engine.train._call_at_rev")
exec(compile(open({call!r}).read().replace("dpnb.engine.train.step import",
                                             "dpnb.engine.train._step_at_rev import"),
             {call!r}, "exec"), _call.__dict__)
from dpnb.core.trainargs import TrainArgs as _Args
import dpnb.engine.train.training as _T
_st = _T.train_state(globals())

class _other:
    train = staticmethod(lambda ns, **kw: _call.train(ns, _Args(**kw)))

def _steps(train, n):
    k0 = len(_st.records)
    train(globals(), steps=n, micro_batch={mb}, publish=True)
    return [r.step_time_s for r in list(_st.records)[k0:]]

_times = _co.defaultdict(list)
_steps(_other.train, {warm})
_steps(_T.train, {warm})
for _ in range({rounds}):
    _times["rev"] += _steps(_other.train, {steps})
    _times["now"] += _steps(_T.train, {steps})
_med = {{k: 1e3 * _stat.median(v) for k, v in _times.items()}}
"""


def _at_rev(rev: str, name: str) -> str:
    """``dpnb/engine/train/NAME.py`` of ``rev``, in a temporary file."""
    src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:dpnb/engine/train/{name}.py"],
                         capture_output=True, text=True, check=True).stdout
    fd, path = tempfile.mkstemp(prefix=f"dpnb-{name}-", suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(src)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, metavar="REV", help="git revision to compare with")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=20, help="steps per side per round (default 20)")
    p.add_argument("--warm", type=int, default=10, help="warm-up steps per side (default 10)")
    p.add_argument("--tiny", action="store_true",
                   help="the suite's tiny sizes (a smoke run: both sides run, numbers made)")
    a = p.parse_args(argv)
    import dpnb
    from suite import SETUP_CELL

    step, call = _at_rev(a.old, "step"), _at_rev(a.old, "call")
    c = dpnb.start(1, backend=a.backend)
    try:
        print(f"backend {c.backend}, device {c.ranks[0].device}; median step ms, 1 rank, DDP")
        print(f"| model | {a.old} | now | now / {a.old} |\n|---|---|---|---|")
        for name in ("mlp", "tinylm"):
            c.run(SETUP_CELL.format(here=HERE, name=name, tiny=a.tiny), display=False)
            c.wrap("net", "ddp")
            c.set_data("ds")
            mb = int(c.pull("mb", rank=0))
            c.run(CELL.format(step=step, call=call, mb=mb, rounds=a.rounds, steps=a.steps,
                              warm=a.warm), display=False)
            m = c.pull("_med", rank=0)
            print(f"| {name} | {m['rev']:.3f} | {m['now']:.3f} | {m['now'] / m['rev']:.3f} |")
    finally:
        c.stop()
        os.unlink(step)
        os.unlink(call)
    return 0


if __name__ == "__main__":
    sys.exit(main())

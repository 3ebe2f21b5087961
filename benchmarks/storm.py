"""Through a storm: 4 ranks on two namespace hosts train while faults land at a set rate.

Two hosts are built from network namespaces on this machine (root only; see
``tests/helpers/hosts.py``), 2 ranks each, joined over ssh as a Slurm or ssh
user's cluster is.  For each strategy (DDP, then ZeRO-2 with peer copies
every ``--copy-every`` steps, each rank's copy held on the other host), in
one run:

1. **calm**: ``%dp train`` in calls of ``--chunk`` steps for ``--minutes``,
   nothing injected: the steps a fault-free run makes in that time;
2. **storm**: the same for the same time, with one fault every ``--every``
   seconds (a random kind, a random rank), recovered the way a user would:
   ``restart --resume`` (from the survivors' memory, no checkpoint folder)
   after a death; after a rank is named frozen, the same (``--on-freeze
   replace``: the restart kills and replaces it) or waiting for its
   ``SIGCONT`` (``--on-freeze wait``); nothing after a mistake (the group
   re-forms itself).

The faults (``--kinds``):

* ``kill``: one rank's engine SIGKILLed from outside, as the OOM killer does;
* ``host``: both ranks of the second host SIGKILLed at once, and its spare
  engines (``--spares``), as a lost machine takes them;
* ``freeze``: one rank SIGSTOPped for ``--freeze-s`` seconds, then SIGCONTed
  (a stuck process, a debugger left attached);
* ``mistake``: a cell that raises on one rank while the others wait in an
  ``all_reduce`` (the REPL's everyday fault).

Per fault: kind, ranks, the step the ranks had reached, the step training
went on from (steps lost), and the seconds from the fault to the first
training call that completed after it.  In all: the steps each phase made
and the throughput kept (storm / calm), engine memory over time, and the
processes and descriptors left after ``stop``.  ``--json`` writes it all;
``--figure`` draws the faults on a timeline beside the loss and the
throughput.

    sudo python benchmarks/storm.py --minutes 30 --every 30 --json storm.json --figure storm.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import dpnb  # noqa: E402
from dpnb.errors import DpnbError, RemoteCellError  # noqa: E402
from dpnb.widgets import incidents as incidents_view  # noqa: E402
from helpers import hosts as _hosts  # noqa: E402

KINDS = ("kill", "host", "freeze", "mistake")
SETUP = """
import dpnb.data, time as _t
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
ds = dpnb.data.SyntheticRegression(n=1 << 16, in_dim=16, out_dim=1, seed=0)
def paced_loss(out, target):
    _t.sleep(0.01)  # a step of about a real one's length on 2 shared cores
    return torch.nn.functional.mse_loss(out, target)
"""
STEP = "from dpnb.engine.train.training import train_state\n_step = train_state(globals()).step"


@dataclass
class Fault:
    at_s: float  # since the phase began
    kind: str
    ranks: tuple[int, ...]
    reached: int | None = None  # the highest step any rank had reached
    resumed: int | None = None  # the step training went on from
    healthy_after_s: float | None = None
    how: str = ""
    pids: tuple[int, ...] = ()  # the signalled processes, as this machine sees them
    said: str = ""  # the first line of the error the training call raised, if any

    @property
    def steps_lost(self) -> int | None:
        if self.reached is None or self.resumed is None:
            return None
        return max(0, self.reached - self.resumed)


@dataclass
class Phase:
    strategy: str
    storm: bool
    seconds: float = 0.0
    began: float = 0.0  # time.time() at the phase's start: its faults' at_s count from here
    steps: int = 0  # training progress made: the last step minus the first
    calls: list = field(default_factory=list)  # (t_s, last_step, loss, steps/s) per call
    faults: list = field(default_factory=list)
    rss_mb: list = field(default_factory=list)  # (t_s, [MB per rank])


def _steps(c) -> list[int]:
    c.run(STEP, display=False)
    return [int(s) for s in c.pull("_step")]


class Injector:
    """Faults at ``every`` seconds (jittered by a quarter), each landing while a
    training call runs: the signals are sent from this thread; a mistake waits for
    the main loop's next call boundary (a cell cannot run beside ``train``)."""

    def __init__(self, c, hs, kinds, every, freeze_s, rng, cycle=False):
        self.c, self.hs, self.kinds, self.every, self.freeze_s, self.rng = \
            c, hs, kinds, every, freeze_s, rng
        self.cycle, self.fired = cycle, 0  # cycle: the kinds in turn, not at random
        self.pending: list[Fault] = []  # sent, not yet recovered
        self.mistakes: list[Fault] = []
        self.frozen: list[tuple[int, float]] = []  # (outer PID, SIGCONT when)
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()
        for pid, _ in self.frozen:  # never leave an engine stopped
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def _loop(self):
        nxt = self.every * (0.75 + 0.5 * self.rng.random())
        while not self._stop.wait(0.1):
            now = time.monotonic() - self.t0
            for pid, when in list(self.frozen):
                if now >= when:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
                    if (pid, when) in self.frozen:  # not forgotten meanwhile (a replace)
                        self.frozen.remove((pid, when))
            if now >= nxt:
                nxt = now + self.every * (0.75 + 0.5 * self.rng.random())
                self.fired += 1
                self._fire(self.kinds[(self.fired - 1) % len(self.kinds) if self.cycle
                                      else self.rng.randrange(len(self.kinds))], now)

    def _fire(self, kind: str, now: float):
        c, hs = self.c, self.hs
        b = hs.hosts[1]
        world = c.world_size
        if kind == "mistake":
            with self._lock:
                self.mistakes.append(Fault(now, kind, (self.rng.randrange(world),)))
            return
        if kind == "host":
            ranks = tuple(r for r in range(world) if c.ranks[r].host == b.name)
        else:
            ranks = (self.rng.randrange(world),)
        try:
            pids = [hs.outer_pid(hs.hosts[0] if c.ranks[r].host != b.name else b, c.ranks[r].pid)
                    for r in ranks]
            if kind == "host" and c.spares is not None:  # a lost machine takes its spares too
                pids += [hs.outer_pid(b, pid) for pid in list(c.spares.pool.get(b.name, ()))]
        except LookupError as e:  # a rank being replaced: no fault this time
            print(f"  (skipped a {kind}: {e})", flush=True)
            return
        for pid in pids:
            os.kill(pid, signal.SIGSTOP if kind == "freeze" else signal.SIGKILL)
        if kind == "freeze":
            self.frozen += [(pid, now + self.freeze_s) for pid in pids]
        with self._lock:
            self.pending.append(Fault(now, kind, ranks, pids=tuple(pids)))

    def forget_frozen(self) -> None:
        """The frozen ranks are being replaced: send them no SIGCONT."""
        self.frozen = []

    def take(self) -> list[Fault]:
        with self._lock:
            out, self.pending = self.pending, []
        return out

    def take_thawed(self) -> list[Fault]:
        """Freezes over (SIGCONT sent) that no call failed on: a short freeze only
        pauses the ranks waiting for it (it ended before being named frozen)."""
        frozen = {pid for pid, _ in self.frozen}
        with self._lock:
            out = [f for f in self.pending if f.kind == "freeze" and not set(f.pids) & frozen]
            self.pending = [f for f in self.pending if f not in out]
        return out

    def take_mistakes(self) -> list[Fault]:
        with self._lock:
            out, self.mistakes = self.mistakes, []
        return out


def _recover(c, inj: Injector | None, on_freeze: str = "wait") -> str:
    """After a failed training call: bring every rank back and the group up.  A rank
    named frozen is waited for (its SIGCONT) or, ``on_freeze="replace"``, replaced
    at once by ``restart --resume`` as a user who wants the run to go on would."""
    deadline = time.monotonic() + 120
    if inj and inj.frozen and on_freeze == "replace":
        inj.forget_frozen()  # the restart kills them: no SIGCONT to a dead PID
        msg = c.restart(resume=True)
        return "frozen rank replaced, restart --resume: " + msg.splitlines()[0][:240]
    while inj and inj.frozen and time.monotonic() < deadline:  # a frozen rank: wait for its SIGCONT
        time.sleep(0.2)
    while c.busy and not c.dead and time.monotonic() < deadline:
        c.status()  # a continued rank's released call ends; status sees it
        time.sleep(0.2)
    if c.dead or c.busy:
        msg = c.restart(resume=True)
        return "restart --resume: " + msg.splitlines()[0][:240]
    return "continued"


def run_phase(c, hs, strategy: str, storm: bool, seconds: float, args, rng, log) -> Phase:
    ph = Phase(strategy, storm)
    inj = Injector(c, hs, args.kinds, args.every, args.freeze_s, rng, args.cycle) if storm else None
    first = last = max(_steps(c))
    t0 = time.monotonic()
    ph.began = time.time()
    if inj:
        inj.t0 = t0
        inj.start()
    open_faults: list[Fault] = []
    try:
        while time.monotonic() - t0 < seconds:
            t_call = time.monotonic()
            try:
                for f in inj.take_mistakes() if inj else ():  # between calls, as a user's cell
                    f.reached = f.resumed = last
                    try:
                        c.run(f"t = torch.ones(1)\nif rank == {f.ranks[0]}:\n"
                              "    raise ValueError('storm')\ndist.all_reduce(t)", display=False)
                    except RemoteCellError as e:
                        f.how = "group re-formed" if e.reformed else "reported"
                    open_faults.append(f)
                s = c.train(steps=args.chunk, micro_batch=8, loss_fn="paced_loss", progress=False)
            except DpnbError as e:  # a fault's, wherever it landed (a call, a restart)
                faults = inj.take() if inj else []
                if not faults and not (c.dead or c.busy):
                    raise
                reached = max([last, *_alive_steps(c)])
                how = _recover(c, inj, args.on_freeze)
                last = max(_steps(c))
                for f in faults:
                    f.reached, f.resumed, f.how = reached, last, how
                    f.said = (str(e).splitlines() or [""])[0][:300]
                open_faults += faults
                log(f"  {strategy} t={time.monotonic() - t0:6.1f}s "
                    f"{'+'.join(f.kind for f in faults) or 'a fault in recovery'} "
                    f"{[f.ranks for f in faults]}: reached {reached}, resumed at {last}; {how} "
                    f"({type(e).__name__})")
                continue
            now = time.monotonic()
            last = s.last_step + 1 if s.last_step is not None else last
            ph.calls.append((round(now - t0, 2), last, s.loss, round(s.steps / (now - t_call), 2)))
            for f in inj.take_thawed() if inj else ():
                f.reached = f.resumed = last
                f.how = "paused, went on after SIGCONT"
                open_faults.append(f)
            for f in open_faults:  # healthy: a training call completed after the fault
                f.healthy_after_s = round(now - t0 - f.at_s, 2)
                ph.faults.append(f)
            open_faults = []
            if len(ph.calls) % 10 == 0:
                ph.rss_mb.append((round(now - t0, 1), [round((r["rss_bytes"] or 0) / 2**20, 1)
                                                       for r in c.status()]))
    finally:
        if inj:
            inj.stop()
    ph.seconds = round(time.monotonic() - t0, 1)
    if inj and (late := inj.take()):  # sent as the phase ended: recovered outside its time
        _recover(c, inj)
        for f in late:
            f.reached = f.resumed = max(_steps(c))
            f.how = "after the phase"
        open_faults += late
    ph.steps = max(_steps(c)) - first
    if open_faults:  # healed only once a training call completes: one, outside the phase
        c.train(steps=1, micro_batch=8, progress=False)
        for f in open_faults:
            f.healthy_after_s = round(time.monotonic() - t0 - f.at_s, 2)
    ph.faults += open_faults
    return ph


def _alive_steps(c) -> list[int]:
    """The step each live, idle rank has reached (a dead rank's is lost with it)."""
    alive = [r for r in range(c.world_size) if r not in c.dead and r not in c.busy]
    if not alive:
        return []
    try:
        c.run(STEP, ranks=alive, display=False, raise_errors=False)
    except DpnbError as e:  # one of them died meanwhile (a whole host): now known dead
        print(f"  (steps not read: {e})", flush=True)
        return _alive_steps(c) if any(r in c.dead for r in alive) else []
    out = []
    for r in alive:
        try:
            out.append(int(c.pull("_step", rank=r)))
        except Exception as e:  # a rank that died just now: its step is lost with it
            print(f"  (rank {r}'s step not read: {e})", flush=True)
    return out


def storm(args, log=print, hs=None) -> dict:
    """The phases ``args`` asks for on two namespace hosts (``hs``, else built here
    and torn down after), and what they measured (see the module's docstring)."""
    rng = random.Random(args.seed)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    fds0 = len(os.listdir("/proc/self/fd"))
    phases: list[Phase] = []
    seen_by: dict[str, dict] = {}  # strategy -> what %dp incidents showed after its phases
    with contextlib.nullcontext(hs) if hs is not None else _hosts.Hosts(2) as hs:
        a, b = hs.hosts
        for strategy in args.strategies:
            c = dpnb.start(4, engines="ssh", ssh_config=hs.ssh_config, timeout=args.group_timeout,
                           remote_python=_hosts.remote_python(), spares=args.spares,
                           launcher_args=[f"{a.name}=2", f"{b.name}=2"])
            try:
                c.run(SETUP, display=False, setup=True)
                c.wrap("net", strategy, optimizer="adamw", lr=0.003)
                c.set_data("ds")
                c.train(steps=args.copy_every + 1, micro_batch=8, progress=False,
                        peer_copy_every=args.copy_every)
                for storm_on in (False, True) if args.calm else (True,):
                    log(f"{strategy}: {'storm' if storm_on else 'calm'} for {args.minutes} min")
                    ph = run_phase(c, hs, strategy, storm_on, args.minutes * 60, args, rng, log)
                    log(f"{strategy}: {ph.steps} steps in {ph.seconds} s, {len(ph.faults)} faults")
                    phases.append(ph)
                assert c.check()["ok"], "replicas out of sync after the storm"
                # what the user's own %dp incidents shows of the same run
                seen = incidents_view.of(c)
                seen_by[strategy] = {"created": c.created, "rows": [asdict(r) for r in seen.rows],
                                     "steps_drawn": len(seen.steps),
                                     "drawn_s": [seen.steps[0].at_s, seen.steps[-1].at_s]
                                     if seen.steps else None}
                if args.incidents_figure:
                    incidents_view.save(args.incidents_figure.replace("STRATEGY", strategy), c)
            finally:
                c.stop()
        time.sleep(1.0)
        left_remote = {h.name: len(hs.remote_pids(h)) for h in hs.hosts}
    leaked = sorted(p.pid for p in psutil.Process().children(recursive=True)
                    if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    out = {"args": {k: v for k, v in vars(args).items() if k not in ("json", "figure")},
           "phases": [asdict(p) | {"faults": [asdict(f) | {"steps_lost": f.steps_lost}
                                              for f in p.faults]} for p in phases],
           "processes_left": {"here": leaked, **left_remote},
           "incidents_seen": seen_by,
           "fds_before_after": (fds0, len(os.listdir("/proc/self/fd")))}
    out["summary"] = summary(phases)
    return out


def summary(phases: list[Phase]) -> dict:
    by = {(p.strategy, p.storm): p for p in phases}
    out = {}
    for strategy in dict.fromkeys(p.strategy for p in phases):
        calm, rough = by.get((strategy, False)), by.get((strategy, True))
        if not calm or not rough:
            continue
        rate = lambda p: p.steps / p.seconds if p.seconds else 0.0  # noqa: E731
        lost = [f.steps_lost for f in rough.faults if f.steps_lost is not None]
        healed = [f.healthy_after_s for f in rough.faults if f.healthy_after_s is not None]
        out[strategy] = {
            "calm_steps": calm.steps, "storm_steps": rough.steps,
            "throughput_kept": round(rate(rough) / rate(calm), 3) if rate(calm) else None,
            "faults": len(rough.faults),
            "by_kind": {k: sum(f.kind == k for f in rough.faults) for k in KINDS},
            "steps_lost_total": sum(lost),
            "steps_lost_by_kind": {k: sum(f.steps_lost or 0 for f in rough.faults if f.kind == k)
                                   for k in KINDS},
            "healthy_after_s_median": round(statistics.median(healed), 2) if healed else None,
            "healthy_after_s_max": max(healed, default=None),
            "not_healed": sum(f.healthy_after_s is None for f in rough.faults),
        }
    return out


def figure(data: dict, path: str) -> None:
    """The storm phases: loss and steps/s per training call over time, each fault a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    storms = [p for p in data["phases"] if p["storm"]]
    colors = {"kill": "tab:red", "host": "black", "freeze": "tab:purple", "mistake": "tab:orange"}
    fig, axes = plt.subplots(2, len(storms), figsize=(6 * len(storms), 5), squeeze=False,
                             sharex="col", constrained_layout=True)
    for j, p in enumerate(storms):
        calls = p["calls"]
        t = [x[0] for x in calls]
        axes[0][j].plot(t, [x[2] for x in calls], lw=0.8, color="0.35")
        kept = data["summary"].get(p["strategy"], {}).get("throughput_kept")
        axes[0][j].set_title(f"{p['strategy']}: {len(p['faults'])} faults"
                             + (f", throughput kept {kept:.0%}" if kept is not None else ""))
        axes[0][j].set_ylabel("loss")
        axes[1][j].plot(t, [x[3] for x in calls], lw=0.8, color="0.35")
        axes[1][j].set_ylabel("steps/s (per call)")
        axes[1][j].set_xlabel("seconds into the storm")
        for f in p["faults"]:  # the fault, and its time until a training call completed
            col = colors.get(f["kind"], "grey")
            for ax in axes[:, j]:
                ax.axvline(f["at_s"], color=col, lw=0.8)
                if f["healthy_after_s"]:
                    ax.axvspan(f["at_s"], f["at_s"] + f["healthy_after_s"], color=col, alpha=0.15, lw=0)
    handles = [plt.Line2D([], [], color=v, label=k) for k, v in colors.items()]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(colors))
    fig.savefig(path, dpi=110)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0, help="each phase's length")
    p.add_argument("--every", type=float, default=30.0, help="seconds between faults")
    p.add_argument("--kinds", type=lambda s: tuple(s.split(",")), default=KINDS)
    p.add_argument("--strategies", type=lambda s: tuple(s.split(",")), default=("ddp", "zero2"))
    p.add_argument("--chunk", type=int, default=20, help="steps per train call")
    p.add_argument("--copy-every", type=int, default=5, help="peer copies every K steps")
    p.add_argument("--freeze-s", type=float, default=8.0)
    p.add_argument("--on-freeze", choices=("wait", "replace"), default="replace",
                   help="a rank named frozen: wait for its SIGCONT, or replace it at once")
    p.add_argument("--spares", type=int, default=1,
                   help="spare engines per host (%%dp start --spares): a dead rank's replacement "
                        "is ready at once; 0 starts each replacement when needed")
    p.add_argument("--group-timeout", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cycle", action="store_true", help="the fault kinds in turn, not at random")
    p.add_argument("--no-calm", dest="calm", action="store_false",
                   help="the storm phases only (no throughput kept is computed)")
    p.add_argument("--json", default=None)
    p.add_argument("--figure", default=None)
    p.add_argument("--incidents-figure", default=None, metavar="PATH",
                   help="also save %%dp incidents' figure of each strategy's run "
                        "(STRATEGY in PATH is replaced by its name)")
    a = p.parse_args(argv)
    if bad := [k for k in a.kinds if k not in KINDS]:
        p.error(f"unknown fault kinds {bad}: choose from {','.join(KINDS)}")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if why := _hosts.missing():
        sys.exit(f"two namespace hosts cannot be built here: {why}")
    out = storm(a)
    print(json.dumps(out["summary"], indent=2))
    print("processes left:", out["processes_left"], "fds before/after:", out["fds_before_after"])
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    if a.figure:
        figure(out, a.figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What JupyterLab's panels draw of a step, as the plain records a kernel publishes.

After each ``train`` call the notebook's kernel asks every rank once (one
engine call, no collective) for the last recorded step's timing record and
for the bytes it holds for model states.  This module reduces those to what
a panel beside the notebook can draw without asking anyone again, and what
fits in the small JSON file the Jupyter server reads (``dpnb.cluster.publish``):

* :class:`SyncPanel`: gradient sync of one step on each rank, as lanes of
  bars (forward, backward, each bucket's all-reduce or FSDP's all-gathers
  and reduce-scatters, the optimizer) with how much communication the step
  waited for (exposed) and how much ran under backward (hidden);
* :class:`MemoryPanel`: each rank's parameters, gradients and optimizer
  state, measured from the tensors against :func:`dpnb.core.exact_rank_bytes`
  for the wrapped model and strategy.

Pure (no torch): the same comparison serves the notebook's memory view.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .exact_memory import ParamSpec, exact_rank_bytes
from .synctimeline import RankTimeline, Segment, rank_timeline

#: more ranks than this: the panel shows the first ones and says how many more
PANEL_RANKS = 8
#: a lane's bars beyond this are merged (a model of hundreds of modules runs backward
#: as hundreds of intervals; the panel draws where backward ran, not each module)
LANE_BARS = 64
MEMORY_PARTS = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class SyncPanel:
    """One step's gradient sync on each shown rank (the latest step every rank recorded):
    each rank's :class:`~dpnb.core.synctimeline.RankTimeline` (seconds from that rank's
    step start), a lane of more than :data:`LANE_BARS` bars merged where it was busy."""

    step: int
    strategy: str
    world_size: int
    ranks: tuple[RankTimeline, ...]

    @property
    def more_ranks(self) -> int:
        return self.world_size - len(self.ranks)

    def as_dict(self) -> dict:
        return {**asdict(self), "more_ranks": self.more_ranks}


def _merged(rt: RankTimeline) -> RankTimeline:
    by_lane: dict[str, list[Segment]] = {}
    for s in rt.segments:
        by_lane.setdefault(s.lane, []).append(s)
    out: list[Segment] = []
    for lane, segs in by_lane.items():
        if len(segs) <= LANE_BARS:
            out += segs
            continue
        spans: list[list[float]] = []  # where the lane was busy, touching bars merged
        for s in sorted(segs, key=lambda x: x.start):
            if spans and s.start <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], s.end)
            else:
                spans.append([s.start, s.end])
        out += [Segment(lane, a, b, f"{lane} ({len(segs)} intervals)") for a, b in spans]
    return replace(rt, segments=tuple(out))


def sync_panel(records: list[dict], world_size: int) -> SyncPanel | None:
    """The latest step every rank recorded (records: each rank's, flat), None if none."""
    by_step: dict[int, dict[int, dict]] = {}
    for r in records:
        by_step.setdefault(int(r["step"]), {})[int(r["rank"])] = r
    whole = [s for s, rs in by_step.items() if len(rs) == world_size]
    if not whole:
        return None
    step = max(whole)
    recs = [by_step[step][k] for k in sorted(by_step[step])][:PANEL_RANKS]
    return SyncPanel(step, str(recs[0].get("strategy", "ddp")), world_size,
                     tuple(_merged(rank_timeline(rec)) for rec in recs))


@dataclass(frozen=True)
class MemoryRank:
    """Bytes one rank holds for model states, per part of :data:`MEMORY_PARTS`."""

    rank: int
    measured: tuple[int, ...]
    predicted: tuple[int, ...]

    def part(self, name: str) -> tuple[int, int]:
        i = MEMORY_PARTS.index(name)
        return self.measured[i], self.predicted[i]


@dataclass(frozen=True)
class MemoryPanel:
    """Measured against the exact model, per rank (``phase``: ``after_step`` -- the
    counts taken right after ``optimizer.step()`` -- or ``now``, between steps, when
    gradients have been freed and are predicted as 0)."""

    strategy: str
    optimizer: str
    world_size: int
    phase: str
    step: int | None
    n_params: int
    mixed_precision: str
    ranks: tuple[MemoryRank, ...]

    def as_dict(self) -> dict:
        d = asdict(self)
        d["parts"] = list(MEMORY_PARTS)
        d["ranks"] = d["ranks"][:PANEL_RANKS]
        d["more_ranks"] = max(0, len(self.ranks) - PANEL_RANKS)
        return d


def memory_panel(snapshots: list[dict]) -> MemoryPanel:
    """Each rank's snapshot (``dpnb.engine.metrics.views.memory_snapshot``, one per
    rank) beside :func:`dpnb.core.exact_rank_bytes` for its model, strategy and optimizer."""
    snaps = sorted(snapshots, key=lambda s: s["rank"])
    s0 = snaps[0]
    ws = int(s0["world_size"])
    specs = [ParamSpec(n, tuple(shape), dt, rg) for n, shape, dt, rg in s0["specs"]]
    pred = exact_rank_bytes(specs, ws, s0["strategy"], s0["optimizer"],
                            gradient_as_bucket_view=bool(s0.get("gradient_as_bucket_view", True)))
    ranks = []
    for snap, p in zip(snaps, pred):
        after = snap.get("phase") == "after_step"
        predicted = (p.params, p.grad_storage if after else 0, p.optimizer_state)
        m = snap["measured"]
        ranks.append(MemoryRank(int(snap["rank"]), tuple(int(m.get(k) or 0) for k in MEMORY_PARTS),
                                tuple(int(x) for x in predicted)))
    return MemoryPanel(s0["strategy"], s0["optimizer"], ws, s0.get("phase", "now"), s0.get("step"),
                       int(s0.get("n_params", sum(sp.numel for sp in specs))),
                       s0.get("mixed_precision", "none"), tuple(ranks))

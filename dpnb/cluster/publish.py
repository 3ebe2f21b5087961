"""A running cluster's small public face: one private JSON file per cluster, for the Jupyter server.

JupyterLab's dpnb sidebar (:mod:`dpnb.lab`) must see every cluster of this
user on this server, the ones a kernel started in code as well as the kept
ones, without asking any kernel anything.  So the kernel holding a cluster
publishes a record of it -- cluster id, profile folder, the kernel's PID and
start time, each rank's host/PID/start time/device and whether the notebook
side saw it die, the latest training progress (step, loss, samples/s),
the last failed cell's one-line summary, the last profiled cell's summary
(:class:`dpnb.core.profilesummary.ProfileSummary`: the sentences the cell's
view prints, two numbers per rank, the traces' folder; never their contents)
and the last train call's step (:mod:`dpnb.core.labviews`: gradient sync as
lanes of bars, memory per rank measured against the exact model)
-- in this user's private folder (:func:`dpnb.engine.proc.private.private_dir`,
mode 0700, files 0600): the server runs as the same user and reads it; nobody
else can.

Who writes when: a daemon thread in the kernel rewrites the file at most
once a second, only when its contents changed; :meth:`Publication.remove`
deletes it when the cluster stops (or a kernel lets go of a kept cluster).
A kernel that dies without its ``atexit`` leaves the file behind, so readers
(:func:`published`) drop records whose kernel process is gone.  Nothing
here talks to the engines: progress comes from what the layer above hands
:meth:`Publication.progress` (rank 0's datapub payload), the profile from what it
hands :meth:`Publication.profile`, liveness from the notebook side's health and the
readers' own PID checks.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref

from ..core.labviews import MemoryPanel, SyncPanel
from ..core.profilesummary import ProfileSummary
from dpnb.engine.proc.private import private_dir
from .processes import json_records, remove_record, same_process, start_time
from .types import Status

log = logging.getLogger(__name__)

#: overrides where publications go (tests point server and kernel at one folder)
PUBLISH_ENV = "DPNB_PUBLISH_DIR"
#: seconds between two looks at the cluster (the sidebar polls about as often)
PERIOD_S = 1.0
_PROGRESS_KEYS = ("step", "loss", "samples_per_s", "tokens_per_s", "step_time_s", "total", "done")
#: the curves JupyterLab's dashboard panel draws: the latest steps' (step, loss, samples/s)
CURVE_MAX = 500


def extend_curve(curve: list[list], data: dict) -> None:
    """Add a progress payload's steps to ``curve`` (``[step, loss, samples/s or None]``,
    steps rising).

    The payload's ``history`` carries the recent steps (a reader polling less
    often than steps finish still gets each); a step at or before the curve's
    last -- a resume that rolled back, a new model's step 0 -- drops what came
    after it, so the curve goes on from there as the training does.
    """
    pts = [(h[0], h[1], h[2] if len(h) > 2 else None)
           for h in data.get("history") or [] if len(h) >= 2]
    for step, loss, sps in pts or [(data.get("step"), data.get("loss"), data.get("samples_per_s"))]:
        if not isinstance(step, int) or not isinstance(loss, (int, float)):
            continue
        while curve and curve[-1][0] >= step:
            curve.pop()
        curve.append([step, float(loss), float(sps) if isinstance(sps, (int, float)) else None])
    del curve[:-CURVE_MAX]


def publish_dir() -> str:
    """``$DPNB_PUBLISH_DIR``, else ``<private dir>/clusters`` (created 0700)."""
    d = os.environ.get(PUBLISH_ENV) or os.path.join(private_dir(), "clusters")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


def error_summary(res) -> str | None:
    """One line for a failed :class:`~dpnb.cluster.types.CellResult`: the first failed rank's
    exception (or how its engine died), and how many ranks failed."""
    if res is None:
        return None
    bad = [o for o in res.outcomes.values() if o.status != Status.OK]
    if not bad:
        return None
    o = min(bad, key=lambda x: x.rank)
    what = o.died or (f"{o.ename}: {o.evalue}" if o.ename else o.status.value)
    line = (what.strip().splitlines() or [""])[0][:200]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return f"rank {o.rank}: {line}{more}"


def _kernel_id() -> str | None:
    """The Jupyter kernel id of this process (from its connection file), if it is a kernel."""
    try:
        # lazy: only a Jupyter kernel has a connection file; scripts have no ipykernel
        from ipykernel.connect import get_connection_file
        name = os.path.basename(get_connection_file())
    except Exception as e:  # not a kernel (a script, a test): no id to give
        log.debug("no kernel connection file: %s: %s", type(e).__name__, e)
        return None
    return name[len("kernel-"):-len(".json")] if name.startswith("kernel-") else None


class Publication:
    """The published record of one :class:`~dpnb.cluster.Engines` (held weakly)."""

    def __init__(self, c, *, period_s: float = PERIOD_S):
        self._ref = weakref.ref(c)
        self.cluster_id = c.cluster_id
        self.path = os.path.join(publish_dir(), f"{self.cluster_id}.json")
        self.period_s = period_s
        self._progress: dict = {}
        self._curve: list[list] = []
        self._profile: dict | None = None
        self._sync: dict | None = None
        self._memory: dict | None = None
        self._written = ""
        self._starts: dict[int, float | None] = {}
        self._kernel = {"pid": os.getpid(), "start": start_time(os.getpid()),
                        "kernel_id": _kernel_id()}
        self._stop = threading.Event()
        # the publication thread and a caller who wants the record out now (after a
        # profile) write the same temporary file: one at a time
        self._writing = threading.Lock()
        self.write()
        self._thread = threading.Thread(target=self._loop, name=f"dpnb-publish-{self.cluster_id}",
                                        daemon=True)
        self._thread.start()

    def progress(self, data: dict | None) -> None:
        """The layer above's latest training progress (rank 0's payload); written within a second."""
        if data:
            self._progress = {k: data[k] for k in _PROGRESS_KEYS if data.get(k) is not None}
            self._progress["at"] = time.time()
            extend_curve(self._curve, data)

    def profile(self, summary: ProfileSummary | None) -> None:
        """The layer above's last profiled cell (None: none yet, or a new one under way)."""
        self._profile = None if summary is None else summary.as_dict()

    def step_views(self, sync: SyncPanel | None, memory: MemoryPanel | None) -> None:
        """The last train call's step as the session read it from the ranks: gradient
        sync on a timeline and memory per rank (None: not recorded, or no model)."""
        self._sync = None if sync is None else sync.as_dict()
        self._memory = None if memory is None else memory.as_dict()

    def record(self, c) -> dict:
        """What the sidebar shows of ``c`` (JSON)."""
        ranks = []
        door = c.agent_door
        for r in c.ranks:
            if r.pid not in self._starts:  # a replaced rank has a new PID
                self._starts[r.pid] = start_time(r.pid) if c.local else None
            ranks.append({"rank": r.rank, "host": r.host, "pid": r.pid,
                          "pid_start": self._starts[r.pid], "device": r.device,
                          "alive": r.rank not in c.dead})
        return {"id": self.cluster_id, "source": "kernel", "kernel": self._kernel,
                "profile_dir": c.profile_dir, "created": c.created, "backend": c.backend,
                "launcher": c.launcher, "local": c.local, "kept": bool(c.keep_s),
                "generation": c.generation, "group_ok": c.group_ok, "ranks": ranks,
                "progress": dict(self._progress), "curve": [list(x) for x in self._curve],
                "last_error": error_summary(c.last_failure),
                "last_profile": self._profile,
                "gradsync": self._sync, "memory": self._memory,
                # the holder's door for dpnb mcp (dpnb.agent.door), and what agents did
                "agent_door": door.path if door is not None else None,
                "agent": door.summary() if door is not None else None}

    def write(self) -> bool:
        """Rewrite the file if the record changed; False once the cluster is gone or stopped."""
        c = self._ref()
        if c is None or not c.running:
            return False
        with self._writing:
            text = json.dumps(self.record(c), default=str, sort_keys=True)
            if text != self._written:
                tmp = self.path + ".tmp"
                with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                    f.write(text)
                os.replace(tmp, self.path)
                self._written = text
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                if not self.write():
                    break
            except Exception as e:  # keep publishing: the next look may work
                log.warning("publishing cluster %s for JupyterLab failed: %s: %s",
                            self.cluster_id, type(e).__name__, e)
        self.remove()

    def remove(self) -> None:
        """The cluster stopped (or this kernel let go of it): no record any more."""
        self._stop.set()
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove %s: %s", self.path, e)


def published(directory: str | None = None) -> list[dict]:
    """Every record whose kernel is still running; stale ones (their kernel died
    without cleaning up) are removed.  Local ranks' ``alive`` also checks the PID."""
    out = []
    for path, rec, err in json_records(directory or publish_dir()):
        k = rec.get("kernel") if isinstance(rec, dict) else None
        if not isinstance(k, dict):  # being written, or not a record: skipped, not removed
            log.info("published cluster record %s unreadable (%s): skipped", path,
                     err or "no kernel")
            continue
        if not same_process(int(k["pid"]), k.get("start")):
            remove_record(path, f"published cluster {rec.get('id')}: its kernel "
                                f"{k.get('pid')} is gone")
            continue
        for r in rec.get("ranks", []) if rec.get("local") else ():
            started = r.get("pid_start")  # None: the engine was gone when first published
            r["alive"] = bool(r["alive"]) and started is not None \
                and same_process(int(r["pid"]), started)
        out.append(rec)
    return out

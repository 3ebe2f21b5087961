"""Clusters that outlive their kernel: ``%dp start --keep TTL``, ``%dp attach``, ``%dp list``.

By default a cluster ends with the kernel that started it.  A kept one does
not: its controller and engines (local engines, each in its own session) go
on holding everything the user built, and a later kernel reattaches to them
through ipyparallel (the controller's connection files stay in the
cluster's 0700 profile) and through the engines' side doors (their token is
in the record).  Nothing runs forever: the cluster's reaper
(:mod:`dpnb._reaper`) watches whichever kernel holds it now, and once none
does, stops every process of the cluster after the time-to-live, by PID and
start time, and removes the profile and the record.

The record -- one JSON file per kept cluster in :func:`state_dir`, readable
only by its user -- holds what the notebook side knew: ranks, the group's
port and generation, the cell history, and the session's part (the setup
steps ``restart --resume`` and ``export`` replay, the train calls).  The
engines' namespaces need no record: the engines never stopped.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time

from .._reaper import KEEP_FILE, write_keep
from ..errors import DpnbError
from .launch import _quiet_ipp_log
from .launchers import launcher_for
from .processes import same_process, start_time
from .types import CellRecord, EntryKind, LaunchSpec, RankInfo

log = logging.getLogger(__name__)

#: overrides where kept clusters are recorded (tests use their own folder)
STATE_ENV = "DPNB_STATE_DIR"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_ttl(text) -> float:
    """``"90s"``, ``"30m"``, ``"2h"``, ``"1d"`` (or seconds as a number) -> seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool) and text > 0:
        return float(text)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise DpnbError(f"--keep {text!r} is not a time to live: give a duration such as 90s, "
                        f"30m, 2h or 1d")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def fmt_duration(s: float) -> str:
    s = max(0.0, s)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.1f} {unit}".replace(".0 ", " ")
    return f"{s:.0f} s"


def state_dir() -> str:
    """Where kept clusters are recorded: ``$DPNB_STATE_DIR``, else the XDG state folder."""
    d = os.environ.get(STATE_ENV) or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "dpnb", "kept")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


def record_of(c, ttl_s: float) -> dict:
    """What a new kernel needs to drive ``c`` (JSON)."""
    return {
        "id": c._ipp.cluster_id, "created": c.created, "ttl_s": ttl_s,
        "profile_dir": c.profile_dir, "cluster_file": c._ipp.cluster_file,
        "ranks": [dict(r.__dict__) for r in c.ranks], "backend": c.backend,
        "master_addr": c.master_addr, "master_port": c.master_port, "timeout_s": c.timeout_s,
        "threads": c.threads, "seed": c.seed, "generation": c.generation,
        "token": c.transport.token, "run_id": c.group.run_id,
        "doors": {str(r): list(a) for r, a in c.transport.doors.items()},
        "env": [list(kv) for kv in c.spec.env],
        # the cells resume infers its replay from (dpnb.session.resume)
        "history": [{"kind": h.kind, "code": h.code, "ranks": list(h.ranks) if h.ranks else None,
                     "setup": h.setup, "ok": h.ok, "names": list(h.names)} for h in c.history],
        # the layer above's keys (dpnb.session: setup_log, train_log, last_wrap,
        # batch_plan, last_train, autosave_dir), beside the runtime's
        **c.session_record(),
    }


def keep_file(profile_dir: str) -> str:
    return os.path.join(profile_dir, KEEP_FILE)


def hold(c, ttl_s: float, *, holding: bool = True) -> str:
    """Write ``c``'s record and tell its reaper whether this kernel holds it
    (``holding=False``: it lets go, and the countdown starts now); the record's path."""

    path = os.path.join(state_dir(), f"{c._ipp.cluster_id}.json")
    tmp = path + ".tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(c.to_record(ttl_s), f, default=str)
    os.replace(tmp, path)
    owner = ({"owner_pid": os.getpid(), "owner_start": start_time(os.getpid())} if holding
             else {"owner_pid": None, "owner_start": None, "detached_at": time.time()})
    write_keep(c.profile_dir, {"ttl_s": ttl_s, **owner, "record": path})
    return path


def kept() -> list[dict]:
    """Every kept cluster still there, with ``age_s``, ``holder`` and ``stops_in_s``;
    records whose cluster is gone are removed."""

    out = []
    d = state_dir()
    for name in sorted(os.listdir(d)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(d, name)
        try:
            with open(path) as f:
                rec = json.load(f)
            with open(keep_file(rec["profile_dir"])) as f:
                k = json.load(f)
        except (OSError, ValueError, KeyError) as e:
            log.info("kept-cluster record %s is stale (%s): removing it", path, e)
            try:
                os.remove(path)
            except OSError as e2:
                log.info("could not remove %s: %s", path, e2)
            continue
        owner = k.get("owner_pid")
        held = owner is not None and same_process(int(owner), k.get("owner_start"))
        since = k.get("detached_at")
        rec.update(path=path, age_s=time.time() - float(rec["created"]),
                   holder=k.get("owner_pid") if held else None,
                   stops_in_s=None if held else float(rec["ttl_s"]) - (
                       time.time() - float(since) if since else 0.0))
        out.append(rec)
    return out


def describe(rec: dict) -> str:
    """One line of ``%dp list``."""
    state = (f"held by kernel {rec['holder']}" + (" (this one)" if rec["holder"] == os.getpid()
                                                  else "")
             if rec["holder"] else f"free, stops in {fmt_duration(rec['stops_in_s'])}")
    return (f"{rec['id']}: {len(rec['ranks'])} ranks, {rec['backend']}, up "
            f"{fmt_duration(rec['age_s'])}, TTL {fmt_duration(rec['ttl_s'])}, {state}")


def choose(cluster_id: str | None) -> dict:
    """The kept cluster ``%dp attach [ID]`` means; one-line errors otherwise."""
    recs = kept()
    if cluster_id:
        recs = [r for r in recs if r["id"] == cluster_id or r["id"].startswith(cluster_id)]
        if not recs:
            raise DpnbError(f"no kept cluster {cluster_id!r}: %dp list shows the kept ones")
    if not recs:
        raise DpnbError("no kept cluster to attach to: start one with %dp start -n 2 --keep 2h")
    if len(recs) > 1:
        raise DpnbError(f"{len(recs)} kept clusters: say which with %dp attach ID ("
                        + "; ".join(describe(r) for r in recs) + ")")
    rec = recs[0]
    if rec["holder"] and rec["holder"] != os.getpid():
        raise DpnbError(f"kept cluster {rec['id']} is held by kernel {rec['holder']}: %dp stop "
                        f"it there, or end that kernel (the cluster stays, and is free)")
    return rec


def release(c) -> None:
    """The kernel holding kept cluster ``c`` lets go (it exits, or ``%dp detach``):
    the record gets the latest logs, the reaper starts the countdown, the
    processes stay."""
    hold(c, c.keep_s, holding=False)
    c.running = False
    c.published.remove()  # the kept record (kept()) describes it from now on
    try:
        c.client.close()
    except Exception as e:  # the sockets go with the process anyway
        log.info("closing the ipyparallel client: %s: %s", type(e).__name__, e)


def attach(cls, cluster_id: str | None = None):
    """A ``cls`` (:class:`dpnb.Cluster`, or any :class:`~dpnb.cluster.Engines`) driving
    the kept cluster ``cluster_id`` (or the only one); this kernel holds it now."""
    c = cls.from_record(choose(cluster_id))
    hold(c, c.keep_s)  # the reaper stops counting down
    return c


def from_record(cls, rec: dict):
    """A ``cls`` connected to the cluster ``rec`` (:func:`record_of`) describes:
    its controller, its ranks, its group's port and generation, its doors and
    token, its history, and the session's part (setup steps, train calls:
    ``restore_session``).  Records of older dpnb lack some keys; they stay empty."""
    import ipyparallel as ipp  # zmq and tornado: only when a cluster is driven


    try:
        icluster = ipp.Cluster.from_file(cluster_file=rec["cluster_file"], log=_quiet_ipp_log())
        icluster.shutdown_atexit = False
        client = icluster.connect_client_sync()
        # a rank whose engine died never registers again: wait for the live ones
        # (local engines), and the restart that follows replaces the dead
        live = sum(1 for r in rec["ranks"] if start_time(int(r["pid"])) is not None)
        client.wait_for_engines(live, timeout=30)
    except Exception as e:
        raise DpnbError(f"kept cluster {rec['id']} does not answer ({type(e).__name__}: {e}); "
                        f"its reaper stops it when its TTL ends") from None
    ranks = [RankInfo(**r) for r in rec["ranks"]]
    spec = LaunchSpec(env=tuple(tuple(kv) for kv in rec["env"]), kept=True)  # local engines
    c = cls(ipp_cluster=icluster, client=client, ranks=ranks, backend=rec["backend"],
            engine_launcher=launcher_for(spec), timeout_s=float(rec["timeout_s"]),
            profile_dir=rec["profile_dir"], master_addr=rec["master_addr"],
            threads=int(rec["threads"]), gpus=None, seed=rec.get("seed"))
    c.transport.token = rec["token"]
    c.transport.doors = {int(r): (a[0], int(a[1])) for r, a in rec["doors"].items()}
    c.group.master_port = int(rec["master_port"])
    c.group.run_id = rec.get("run_id") or c.group.run_id  # replacements join the same run
    c.health.generation = int(rec["generation"])
    c.created, c.keep_s = float(rec["created"]), float(rec["ttl_s"])
    for h in rec.get("history") or []:  # records of older dpnb have none
        c.history.append(CellRecord(kind=EntryKind(h["kind"]), code=h["code"], setup=h["setup"],
                                    ok=h["ok"], ranks=tuple(h["ranks"]) if h["ranks"] else None,
                                    names=tuple(h["names"])))
    c.restore_session(rec)
    return c


def forget(c) -> None:
    """Remove the record of kept cluster ``c`` (stopped for good)."""
    path = os.path.join(state_dir(), f"{c._ipp.cluster_id}.json")
    try:
        os.remove(path)
    except FileNotFoundError:
        pass  # the reaper removed it, or it was never written
    except OSError as e:
        log.warning("could not remove the kept-cluster record %s: %s", path, e)

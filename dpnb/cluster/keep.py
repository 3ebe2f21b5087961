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
port and generation, the cell history -- put together from each part's own
record (``to_record`` of the world, the group, the transport, the launcher)
and read back by each (``from_record`` / ``restore``) -- and the session's part
(the setup steps ``restart --resume`` and ``export`` replay, the train calls).  The engines'
namespaces need no record: the engines never stopped.
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
from .group import Group
from .launchers import from_record as launcher_from_record
from .processes import json_records, remove_record, same_process, start_time
from .worldref import World
from .types import CellRecord

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
    """Where kept clusters are recorded: ``$DPNB_STATE_DIR``, else the XDG state folder.
    One line saying what to set where it cannot be written (a hosted server's read-only home)."""
    d = os.environ.get(STATE_ENV) or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "dpnb", "kept")
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        writable = os.access(d, os.W_OK | os.X_OK)
    except OSError as e:
        writable, d = False, f"{d} ({e.strerror})"
    if not writable:
        raise DpnbError(f"a kept cluster's record goes in {d}, which this user cannot write "
                        f"(a read-only home?): set {STATE_ENV} to a writable folder")
    return d


def checked_ttl(text) -> float:
    """:func:`parse_ttl`, and the record's folder is writable: both before anything starts."""
    ttl = parse_ttl(text)
    state_dir()
    return ttl


def record_of(c, ttl_s: float) -> dict:
    """What a new kernel needs to drive ``c`` (JSON): the cluster's own keys and
    each part's own record -- the world (ranks, port, generation, doors), the
    group's settings, the transport's token, the launcher's -- and the layer
    above's (``session_record``: setup_log, train_log, last_wrap, ...)."""
    rec = {"id": c.cluster_id, "created": c.created, "ttl_s": ttl_s,
           "profile_dir": c.profile_dir, "cluster_file": c.cluster_file,
           # the cells resume infers its replay from (dpnb.session.resume)
           "history": [h.to_record() for h in c.history]}
    for part in (c.world, c.group, c.transport, c.engine_launcher):
        own = part.to_record()
        if own.keys() & rec.keys():  # two parts writing one key: one would be lost
            raise AssertionError(f"{type(part).__name__} writes {sorted(own.keys() & rec.keys())}"
                                 f" again")
        rec.update(own)
    return {**rec, **c.session_record()}


def keep_file(profile_dir: str) -> str:
    return os.path.join(profile_dir, KEEP_FILE)


def hold(c, ttl_s: float, *, holding: bool = True) -> str:
    """Write ``c``'s record and tell its reaper whether this kernel holds it
    (``holding=False``: it lets go, and the countdown starts now); the record's path."""

    path = os.path.join(state_dir(), f"{c.cluster_id}.json")
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
    try:
        d = state_dir()
    except DpnbError as e:  # nowhere to keep one: none kept (the server's listing goes on)
        log.info("no kept clusters: %s", e)
        return out
    for path, rec, err in json_records(d):
        try:
            if err is not None:
                raise err
            with open(keep_file(rec["profile_dir"])) as f:
                k = json.load(f)
        except (OSError, ValueError, KeyError) as e:
            remove_record(path, f"kept-cluster record stale ({e})")
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
    c.close_agent_door()  # the next holder opens its own
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
    world = World.from_record(rec)
    c = cls(ipp_cluster=icluster, client=client, ranks=list(world.ranks),
            engine_launcher=launcher_from_record(rec), profile_dir=rec["profile_dir"],
            gpus=None, **Group.settings_of(rec))
    c.worlds.set(world)
    c.transport.restore(rec)
    c.group.restore(rec)
    c.created, c.keep_s = float(rec["created"]), float(rec["ttl_s"])
    # records of older dpnb have no history
    c.history.extend(CellRecord.from_record(h, seq=i) for i, h in enumerate(rec.get("history") or []))
    c.restore_session(rec)
    return c.go_live()


def forget(c) -> None:
    """Remove the record of kept cluster ``c`` (stopped for good)."""
    path = os.path.join(state_dir(), f"{c.cluster_id}.json")
    try:
        os.remove(path)
    except FileNotFoundError:
        pass  # the reaper removed it, or it was never written
    except OSError as e:
        log.warning("could not remove the kept-cluster record %s: %s", path, e)


class Kept:
    """What a cluster does to outlive its kernel (a mixin of
    :class:`~dpnb.cluster.Engines`): its record follows its ranks, a new kernel
    attaches to it, and at this process's exit it is let go rather than stopped."""

    def refresh_keep_record(self) -> None:
        """A kept cluster's record follows its ranks (after a restart or a resize)."""
        if self.keep_s:
            hold(self, self.keep_s)

    def session_record(self) -> dict:
        """What the layer above keeps beside the runtime's record (``--keep``); none here."""
        return {}

    def restore_session(self, rec: dict) -> None:
        """Take back what :meth:`session_record` wrote (``%dp attach``); nothing here."""

    @classmethod
    def attach(cls, cluster_id: str | None = None) -> "Kept":
        """Drive a cluster a kernel left running with ``keep``; see :mod:`.keep`."""
        return attach(cls, cluster_id)

    def to_record(self, ttl_s: float) -> dict:
        """What a new kernel needs to drive this cluster (JSON; :func:`.keep.record_of`)."""
        return record_of(self, ttl_s)

    @classmethod
    def from_record(cls, rec: dict) -> "Kept":
        """Drive the cluster a :meth:`to_record` describes (:func:`.keep.from_record`)."""
        return from_record(cls, rec)

    def _at_exit(self) -> None:
        if self.keep_s and self.running:
            release(self)
        else:
            self.stop()

"""The notebook side of a dpnb cluster: engines, ranks, process group, cells.

A :class:`Cluster` owns one ipyparallel cluster (a controller and one engine
per rank) and knows which engine is which rank.  Ranks are assigned once
from the engines' hosts and sorted engine ids (contiguous per host, like
torchrun), never from a single engine id, because ids change when engines
are replaced.

Who talks to whom:

* notebook <-> engines: ipyparallel (ZeroMQ through the controller) carries
  code, function calls *by dotted name*, pushed/pulled values and streamed
  output; this channel is independent of torch.distributed and keeps working
  when a collective hangs;
* engine <-> engine: torch.distributed (gloo on CPU, NCCL between GPUs),
  formed with ``init_process_group(timeout=...)`` against a TCP store served
  by rank 0.  The short timeout is what turns a peer that raised, hung or died
  into an error on the waiting ranks rather than an endless hang.

After a collective error the group is destroyed and re-formed on a fresh
port; the engines' namespaces (models, optimizers, tensors) are untouched.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from . import output as out
from .errors import (
    DpnbError,
    NotRunningError,
    RemoteCellError,
    StartError,
)
from .ranks import parse_ranks, rank_label

BACKENDS = ("auto", "gloo", "nccl")
LAUNCHERS = ("local", "mpi", "slurm", "ssh")
DEFAULT_TIMEOUT_S = 30.0
_SETUP = "dpnb.engine.setup"
# engine-side exception types that mean "bad input, say so in one line"
_USER_ENAMES = {"TrainError", "CheckpointError", "ViewError", "DpnbError"}

log = logging.getLogger("dpnb")


@dataclass(frozen=True)
class RankInfo:
    """Where one rank lives."""

    rank: int
    engine_id: int
    host: str
    ip: str
    pid: int
    local_rank: int
    local_world_size: int
    node_rank: int
    device: str


@dataclass
class RankOutcome:
    """What one rank did in one cell or call."""

    rank: int
    status: str = "pending"  # ok | error | died | timeout | interrupted
    value: Any = None
    ename: str = ""
    evalue: str = ""
    traceback: str = ""
    stdout: str = ""
    stderr: str = ""
    outputs: list = field(default_factory=list)
    execute_result: dict | None = None
    died: str = ""
    collective: bool = False  # the error came from a collective / the group


@dataclass
class CellResult:
    """The per-rank outcome of :meth:`Cluster.run` or :meth:`Cluster.call`."""

    ranks: list[int]
    outcomes: dict[int, RankOutcome]
    elapsed_s: float
    streamed: bool = False

    @property
    def ok(self) -> bool:
        return all(o.status == "ok" for o in self.outcomes.values())

    @property
    def values(self) -> list:
        return [self.outcomes[r].value for r in self.ranks]

    @property
    def stdout(self) -> dict[int, str]:
        return {r: self.outcomes[r].stdout for r in self.ranks}


def start(n: int = 2, **kwargs) -> "Cluster":
    """Start ``n`` engines joined in one process group; see :meth:`Cluster.start`."""
    return Cluster.start(n, **kwargs)


def _parse_gpus(gpus: str | Sequence[int] | None) -> list[int] | None:
    if gpus is None or gpus == "":
        return None
    if isinstance(gpus, str):
        try:
            return [int(g) for g in gpus.split(",") if g.strip() != ""]
        except ValueError:
            raise DpnbError(f"bad --gpus {gpus!r}: give device ordinals like '0,1,2,3'") from None
    return [int(g) for g in gpus]


class Cluster:
    """A running set of engines, one per rank, in one process group.

    Create with :func:`dpnb.start` / :meth:`Cluster.start`.  Methods mirror
    the ``%dp`` magics: :meth:`run` (``%%dp``), :meth:`call`, :meth:`push`,
    :meth:`pull`, :meth:`status`, :meth:`restart`, :meth:`stop`.
    """

    def __init__(self, *, ipp_cluster, client, ranks: list[RankInfo], backend: str,
                 launcher: str, timeout_s: float, profile_dir: str, master_addr: str,
                 master_port: int, threads: int, gpus: list[int] | None, local: bool):
        self._ipp = ipp_cluster
        self.client = client
        self.ranks = ranks
        self.backend = backend
        self.launcher = launcher
        self.timeout_s = timeout_s
        self.profile_dir = profile_dir
        self.master_addr = master_addr
        self.master_port = master_port
        self.threads = threads
        self.gpus = gpus
        self.local = local
        self.running = True
        self.dead: dict[int, str] = {}  # rank -> how it died
        self.busy: set[int] = set()  # ranks still running a cell we stopped waiting for
        self.group_ok = True
        self.generation = 1
        self._reaper: subprocess.Popen | None = None
        self._views: dict[int, Any] = {}  # engine id -> its DirectView (see _view)
        # A kernel that exits normally stops its cluster (and removes the
        # profile with its keys); a weak reference lets an unused Cluster go.
        ref = weakref.ref(self)
        atexit.register(lambda: (ref() is not None and ref().stop()))
        self.last_train: dict | None = None  # filled by dpnb.train
        self.last_wrap: dict | None = None
        # What built the ranks' state, in order: cells that succeeded on every
        # rank and the wrap/data calls.  ``restart(resume=DIR)`` replays it so
        # that a replaced engine can hold the model again before the
        # checkpoint is loaded.
        self.setup_log: list[tuple[str, Any]] = []

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, n: int = 2, *, backend: str = "auto", engines: str = "local",
              gpus: str | Sequence[int] | None = None, timeout: float = DEFAULT_TIMEOUT_S,
              threads: int | None = None, start_timeout: float = 120.0,
              launcher_args: Sequence[str] | None = None,
              controller_ip: str | None = None) -> "Cluster":
        """Start ``n`` engines and join them in a torch.distributed group.

        ``backend``: ``auto`` picks NCCL when every engine has a GPU of its
        own, else gloo.  ``engines``: the ipyparallel launcher (``local``,
        ``mpi``, ``slurm``, ``ssh``); extra launcher options go in
        ``launcher_args`` (e.g. ``["--oversubscribe"]`` for mpiexec).
        ``gpus``: device ordinals to use per host (``"0,1"``), rank ``i`` on a
        host gets ``gpus[local_rank]``.  ``timeout``: seconds any collective
        may wait for a peer before it errors (the process-group timeout).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise DpnbError(f"-n must be a whole number of engines >= 1 (got {n!r}); try -n 2")
        if backend not in BACKENDS:
            raise DpnbError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        if engines not in LAUNCHERS:
            raise DpnbError(f"unknown launcher {engines!r}: choose one of {', '.join(LAUNCHERS)}")
        if not (timeout > 0):
            raise DpnbError(f"--timeout must be > 0 seconds (got {timeout}); e.g. --timeout 30")
        if threads is not None and threads < 1:
            raise DpnbError(f"--threads must be >= 1 (got {threads})")
        gpu_list = _parse_gpus(gpus)
        local = engines == "local"
        if local and backend == "nccl":
            ngpu = _local_gpu_count()
            avail = len(gpu_list) if gpu_list is not None else ngpu
            if gpu_list is not None and any(g >= ngpu or g < 0 for g in gpu_list):
                raise DpnbError(f"--gpus {gpus} names devices this host does not have "
                                f"(it has {ngpu} GPU{'s' if ngpu != 1 else ''})")
            if n > avail:
                raise DpnbError(
                    f"-n {n} with --backend nccl needs {n} GPUs but this host has {avail}"
                    f"{' selected' if gpu_list is not None else ''}: use -n {max(avail, 1)}"
                    f"{'' if avail else ' with --backend gloo'} or --backend gloo")

        import ipyparallel as ipp

        profile_dir = tempfile.mkdtemp(prefix="dpnb-profile-")  # 0700: keys stay private
        # ipyparallel logs every engine's exit (with its output) as a warning
        # when the cluster stops; in a notebook that lands in the cell as red
        # stderr.  Start failures read the engine output directly instead.
        ipp_log = logging.getLogger("dpnb.ipyparallel")
        ipp_log.setLevel(logging.ERROR)
        ipp_log.propagate = False
        if not ipp_log.handlers:
            ipp_log.addHandler(logging.NullHandler())
        kwargs: dict[str, Any] = dict(
            n=n, engines=engines, profile_dir=profile_dir, log=ipp_log,
            engine_timeout=int(start_timeout), shutdown_atexit=True, parent=None,
        )
        # Engines started on this host (local, mpiexec without a hostfile)
        # reach the controller on loopback; nothing listens outside.  Batch /
        # ssh engines run elsewhere, so the controller must listen on all
        # interfaces; ipyparallel signs every message with the cluster's key.
        kwargs["controller_ip"] = controller_ip or (
            "127.0.0.1" if engines in ("local", "mpi") else "*")
        icluster = ipp.Cluster(**kwargs)
        # An engine counts as registered only once the controller's heart
        # monitor has seen it beat, and by default it beats every 3 s: up to
        # 3 s of every start spent waiting.  Beat every second instead, and
        # allow 30 misses, so an engine still has 30 s to answer, as before.
        icluster.controller_args = [*icluster.controller_args, "--HeartMonitor.period=1000",
                                    "--HeartMonitor.max_heartmonitor_misses=30"]
        if engines == "mpi":
            # mpiexec refuses to run as root and to place more ranks than cores
            # unless told; dpnb's own processes are what it launches here.
            icluster.config.MPILauncher.mpi_args = list(launcher_args or [])
            if os.geteuid() == 0:
                env = icluster.config.MPILauncher.get("environment", {})
                icluster.config.MPIEngineSetLauncher.environment = {
                    **env, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        elif launcher_args:
            _apply_launcher_args(icluster, engines, launcher_args)
        try:
            if engines == "local":
                client = _start_overlapped(icluster, n, start_timeout)
            else:
                client = icluster.start_and_connect_sync(n=n)
        except BaseException as e:
            logs = _engine_logs(icluster)
            _stop_quietly(icluster)
            shutil.rmtree(profile_dir, ignore_errors=True)
            if isinstance(e, KeyboardInterrupt):
                raise
            raise StartError(f"could not start {n} engines with the {engines} launcher: "
                             f"{type(e).__name__}: {e}{logs}") from None
        try:
            return cls._form(icluster, client, n=n, backend=backend, engines=engines,
                             gpus=gpu_list, timeout=timeout, threads=threads,
                             profile_dir=profile_dir, local=local)
        except BaseException:
            try:
                client.close()
            except Exception:
                pass
            _stop_quietly(icluster)
            shutil.rmtree(profile_dir, ignore_errors=True)
            raise

    @classmethod
    def _form(cls, icluster, client, *, n, backend, engines, gpus, timeout, threads,
              profile_dir, local) -> "Cluster":
        eids = sorted(client.ids)[:n]
        probes = {eid: p for eid, p in zip(eids, client[eids].apply_sync(_fn("probe")))}
        ranks = assign_ranks(probes)
        by_host_gpus = {r.host: probes[r.engine_id]["cuda_devices"] for r in ranks}
        lws = {r.host: r.local_world_size for r in ranks}
        if backend == "auto":
            enough = all(by_host_gpus[h] >= (len(gpus) if gpus else lws[h]) >= lws[h]
                         for h in lws) if all(by_host_gpus.values()) else False
            backend = "nccl" if enough else "gloo"
        elif backend == "nccl":
            short = {h: g for h, g in by_host_gpus.items()
                     if g < lws[h] or (gpus is not None and len(gpus) < lws[h])}
            if short:
                h, g = next(iter(short.items()))
                raise DpnbError(f"--backend nccl needs one GPU per engine, but host {h} runs "
                                f"{lws[h]} engines and has {g} GPUs: use fewer engines or gloo")
        cpu = min(probes[e]["cpu_count"] for e in eids)
        if threads is None:
            threads = max(1, cpu // max(lws.values()))
        master_addr = "127.0.0.1" if local else ranks[0].ip
        port = 0  # rank 0 opens the store's socket once it has its identity
        kernel_pid = os.getpid()
        final: list[RankInfo] = []
        infos = []
        for r in ranks:
            dev_idx = None
            if backend == "nccl":
                dev_idx = gpus[r.local_rank] if gpus else r.local_rank
            dev = f"cuda:{dev_idx}" if dev_idx is not None else "cpu"
            final.append(RankInfo(**{**r.__dict__, "device": dev}))
            infos.append(dict(rank=r.rank, world_size=len(ranks), local_rank=r.local_rank,
                              local_world_size=r.local_world_size, node_rank=r.node_rank,
                              backend=backend, device_index=dev_idx, master_addr=master_addr,
                              master_port=port, timeout_s=timeout, threads=threads,
                              local_cluster=local,
                              watch_ppid=kernel_pid if (local and probes[r.engine_id]["ppid"] == kernel_pid) else None))
        self = cls(ipp_cluster=icluster, client=client, ranks=final, backend=backend,
                   launcher=engines, timeout_s=timeout, profile_dir=profile_dir,
                   master_addr=master_addr, master_port=port, threads=threads, gpus=gpus,
                   local=local)
        self._init_ranks(infos)
        port = self._view(0).apply_sync(_fn("listen_store"), master_addr)
        self.master_port = port
        res = self._call_all(_SETUP + ".form_group", (port,), timeout=timeout + 15)
        if not res.ok:
            raise StartError("the engines started but could not form a process group: "
                             + _first_error(res))
        # The preload imports end on every rank before the start returns, so
        # the first cell does not wait for them.
        self._call_all(_SETUP + ".preload_done", timeout=timeout + 15)
        # Our controller and engines (or mpiexec) are children of this process
        # for every launcher but ssh/slurm's remote side, so guard them all.
        self._start_reaper()
        return self

    # --------------------------------------------------------------- basics
    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def n(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (f"<dpnb.Cluster {state}: {self.world_size} ranks, {self.backend}, "
                f"{self.launcher} launcher>")

    def _check_running(self) -> None:
        if not self.running:
            raise NotRunningError("this cluster was stopped: start a new one with %dp start -n 2")

    def _eid(self, rank: int) -> int:
        return self.ranks[rank].engine_id

    def _view(self, rank: int):
        """The single-engine view of ``rank``'s engine, made once per engine:
        building a DirectView costs more than sending a short cell."""
        eid = self.ranks[rank].engine_id
        v = self._views.get(eid)
        if v is None:
            v = self._views[eid] = self.client[eid]
        return v

    def _init_ranks(self, infos: list[dict]) -> None:
        """:func:`dpnb.engine.setup.init_rank` on every rank, ``infos[r]`` for
        rank ``r``: all sent before any is waited for, one round trip in all."""
        pending = [self._view(r).apply_async(_fn("init_rank"), info)
                   for r, info in enumerate(infos)]
        for ar in pending:
            ar.get()

    def _select(self, ranks) -> list[int]:
        self._check_running()
        sel = parse_ranks(ranks, self.world_size)
        self._refresh_busy()
        dead = [r for r in sel if r in self.dead]
        if dead:
            raise DpnbError(f"{rank_label(dead)} died ({self.dead[dead[0]]}): run %dp restart "
                            f"to bring the world back to {self.world_size} ranks")
        busy = [r for r in sel if r in self.busy]
        if busy:
            raise DpnbError(f"{rank_label(busy)} still running an earlier cell: wait, or "
                            f"%dp interrupt, or %dp restart")
        return sel

    # ------------------------------------------------------------------ run
    def run(self, code: str, ranks=None, *, timeout: float | None = None,
            stream: bool = True, display: bool = True, raise_errors: bool = True) -> CellResult:
        """Run ``code`` on the selected ranks (all by default), like ``%%dp``.

        Each rank runs the cell in its own namespace with IPython (so
        ``!cmd``, ``%magic`` and the last expression's value work).  Output
        streams while the cell runs and is then shown grouped by rank, with
        identical output shown once.  ``timeout`` bounds the cell's wall time:
        ranks still running then are interrupted and reported.
        """
        sel = self._select(ranks)
        if not isinstance(code, str):
            raise DpnbError("code must be a string of Python source")
        ars = {r: self._view(r).execute(code, silent=False, block=False)
               for r in sel}
        res = self._wait(ars, sel, timeout=timeout, stream=stream and display, kind="execute")
        if display:
            out.show_result(res)
        if res.ok and len(sel) == self.world_size:
            self.setup_log.append(("cell", code))
        return self._finish(res, raise_errors)

    def call(self, dotted: str, *args, ranks=None, timeout: float | None = None,
             raise_errors: bool = True, display: bool = False, on_poll=None,
             **kwargs) -> CellResult:
        """Call the engine-side function ``dotted(ns, *args, **kwargs)`` on ranks.

        Only the dotted name travels; the function must live in ``dpnb``.
        Errors are handled like :meth:`run` (report, group re-formation).
        """
        sel = self._select(ranks)
        res = self._call(dotted, args, kwargs, sel, timeout=timeout, stream=display,
                         on_poll=on_poll)
        if display:
            out.show_result(res)
        return self._finish(res, raise_errors)

    def _call(self, dotted, args, kwargs, sel, *, timeout=None, stream=False,
              on_poll=None) -> CellResult:
        ars = {r: self._view(r).apply_async(_runner("call"), dotted, tuple(args),
                                                         dict(kwargs)) for r in sel}
        return self._wait(ars, sel, timeout=timeout, stream=stream, kind="apply",
                          on_poll=on_poll)

    def _call_all(self, dotted, args=(), *, timeout=None) -> CellResult:
        sel = list(range(self.world_size))
        ars = {r: self._view(r).apply_async(_fn(dotted.rsplit(".", 1)[1]), *args)
               for r in sel}
        return self._wait(ars, sel, timeout=timeout, stream=False, kind="apply")

    def _finish(self, res: CellResult, raise_errors: bool) -> CellResult:
        if res.ok:
            return res
        plain = self._plain_user_error(res)
        err = plain if plain is not None else self._diagnose(res)
        if raise_errors:
            raise err
        res.error = err  # type: ignore[attr-defined]
        return res

    # --------------------------------------------------------------- waiting
    def _wait(self, ars: dict, sel: list[int], *, timeout, stream, kind,
              on_poll=None) -> CellResult:
        """Wait for every rank, watching for deaths, timeouts and Ctrl-C."""
        t0 = time.monotonic()
        outcomes = {r: RankOutcome(rank=r) for r in sel}
        pending = set(sel)
        streamer = out.Streamer(self, ars, delay_s=1.0) if stream else None
        interrupted_at: float | None = None
        timeout_hit = False
        grace = self.timeout_s + 10.0  # interrupted ranks blocked in a collective wake by then
        try:
            while pending:
                try:
                    first = min(pending)
                    ars[first].wait(0.05)
                    for r in list(pending):
                        if ars[r].ready():
                            self._collect(r, ars[r], outcomes[r], kind)
                            pending.discard(r)
                    if streamer is not None:
                        streamer.poll()
                    if on_poll is not None:
                        on_poll(ars)
                    if pending:
                        for r, how in self._find_dead(pending).items():
                            outcomes[r].status, outcomes[r].died = "died", how
                            self._copy_streams(ars[r], outcomes[r])
                            pending.discard(r)
                            self.dead[r] = how
                    now = time.monotonic()
                    if pending and timeout and not timeout_hit and now - t0 > timeout:
                        timeout_hit = True
                        for r in pending:
                            outcomes[r].status = "timeout"
                        self._interrupt(pending)
                        interrupted_at = now
                    if pending and interrupted_at is not None and now - interrupted_at > grace:
                        break
                except KeyboardInterrupt:
                    if interrupted_at is not None:
                        break  # second Ctrl-C: stop waiting, ranks stay marked busy
                    self._interrupt(pending)
                    interrupted_at = time.monotonic()
                    for r in pending:
                        outcomes[r].status = "interrupted"
        finally:
            if streamer is not None:
                streamer.close()
        for r in pending:  # gave up waiting: the engine is still busy with it
            o = outcomes[r]
            if o.status == "pending":
                o.status = "timeout"
            self._copy_streams(ars[r], o)
            self.busy.add(r)
        res = CellResult(ranks=sel, outcomes=outcomes, elapsed_s=time.monotonic() - t0,
                         streamed=bool(streamer and streamer.started))
        return res

    def _collect(self, r: int, ar, o: RankOutcome, kind: str) -> None:
        prior = o.status
        try:
            # results travel on a different socket than printed output; wait
            # for the engine's "idle" so no late stdout is lost
            ar.wait_for_output(5)
        except Exception:
            pass
        self._copy_streams(ar, o)
        try:
            o.value = ar.get(0)
            if kind == "execute":
                o.value = None
            o.status = "ok" if prior == "pending" else prior
            if prior in ("timeout", "interrupted"):
                o.status = "ok"  # it finished after all within the grace period
        except Exception as e:
            o.ename = getattr(e, "ename", type(e).__name__)
            o.evalue = str(getattr(e, "evalue", e))
            tb = getattr(e, "traceback", None)
            o.traceback = tb if isinstance(tb, str) else "\n".join(tb or [])
            o.collective = out.is_collective_error(o.ename, o.evalue, o.traceback)
            if o.ename == "EngineError":  # ipyparallel noticed the engine vanish
                o.status, o.died = "died", self._death_cause(r) or o.evalue
                self.dead[r] = o.died
            elif prior in ("timeout", "interrupted") and o.ename == "KeyboardInterrupt":
                o.status = prior
            else:
                o.status = "error"

    @staticmethod
    def _copy_streams(ar, o: RankOutcome) -> None:
        try:
            # the raw dict: ``ar.metadata`` first parses every timestamp in it
            # with dateutil, a millisecond per cell that nothing here reads
            raw = getattr(ar, "_metadata", None)
            md = raw[0] if isinstance(raw, list) and raw else ar.metadata
            md = md[0] if isinstance(md, list) else md
            o.stdout, o.stderr = md.get("stdout", "") or "", md.get("stderr", "") or ""
            o.outputs = list(md.get("outputs", []) or [])
            o.execute_result = md.get("execute_result")
        except Exception:
            pass

    def _death_cause(self, r: int, wait_s: float = 3.0) -> str | None:
        """How rank ``r``'s engine ended, waiting briefly for it to be reaped."""
        deadline = time.monotonic() + wait_s
        while True:
            how = self._find_dead([r]).get(r)
            if how is not None or time.monotonic() > deadline:
                return how
            time.sleep(0.05)

    def _find_dead(self, ranks: Iterable[int]) -> dict[int, str]:
        """Ranks whose engine process is gone, with how it ended if known."""
        dead: dict[int, str] = {}
        if self.local:
            for r in ranks:
                pid = self.ranks[r].pid
                how = _local_exit(self._ipp, pid)
                if how is not None:
                    dead[r] = how
        else:
            alive = set(self.client.ids)
            for r in ranks:
                if self._eid(r) not in alive:
                    dead[r] = "its engine unregistered from the controller"
        return dead

    def _refresh_busy(self) -> None:
        if not self.busy:
            return
        try:
            qs = self.client.queue_status()
        except Exception:
            return
        for r in list(self.busy):
            st = qs.get(self._eid(r), {})
            if isinstance(st, dict) and st.get("queue", 0) == 0 and st.get("tasks", 0) == 0:
                self.busy.discard(r)
        for r, how in self._find_dead(list(self.busy)).items():
            self.busy.discard(r)
            self.dead[r] = how

    def _interrupt(self, ranks: Iterable[int]) -> None:
        """Send SIGINT to the engines of ``ranks`` (KeyboardInterrupt there).

        A rank blocked inside a gloo collective only sees it when the
        collective returns (at the latest at the group timeout); a rank in
        Python code stops at once.
        """
        ranks = [r for r in ranks if r not in self.dead]
        if not ranks:
            return
        if self.local:
            for r in ranks:
                try:
                    os.kill(self.ranks[r].pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        else:
            try:
                self.client.send_signal(signal.SIGINT, targets=[self._eid(r) for r in ranks],
                                        block=False)
            except Exception:
                pass

    def interrupt(self, ranks=None) -> None:
        """Interrupt what the selected ranks are running (all by default)."""
        self._check_running()
        self._interrupt(parse_ranks(ranks, self.world_size))

    # ------------------------------------------------------------ diagnose
    @staticmethod
    def _plain_user_error(res: CellResult) -> DpnbError | None:
        """Every rank refused the same bad input: one line, no traceback.

        dpnb's engine functions raise ``TrainError`` (and friends) for
        mistakes the user can fix, on every rank alike, before any
        collective; that deserves the one-line message, not a report.
        """
        outs = [res.outcomes[r] for r in res.ranks]
        if all(o.status == "error" and o.ename in _USER_ENAMES for o in outs) and \
                len({o.evalue for o in outs}) == 1:
            return DpnbError(outs[0].evalue)
        return None

    def _diagnose(self, res: CellResult) -> RemoteCellError:
        """Turn per-rank outcomes into one report; re-form the group if needed."""
        failures = {r: o for r, o in res.outcomes.items() if o.status != "ok"}
        died = {r: o.died for r, o in failures.items() if o.status == "died"}
        timed_out = sorted(r for r, o in failures.items() if o.status == "timeout")
        user_fail = sorted(r for r, o in failures.items()
                           if o.status == "error" and not o.collective)
        coll = sorted(r for r, o in failures.items() if o.status == "error" and o.collective)
        interrupted = sorted(r for r, o in failures.items() if o.status == "interrupted")
        culprits = sorted(set(user_fail) | set(died) | set(timed_out))
        waiting = coll if culprits else []
        reformed, reform_msg = False, ""
        needs_reform = bool(coll or timed_out or interrupted) or (died and False)
        if died:
            self.group_ok = False
            reform_msg = (f"The process group cannot continue without {rank_label(died)}: "
                          f"run %dp restart to replace it and re-form the group "
                          f"({_kept(r for r in range(self.world_size) if r not in died)}).")
        elif needs_reform and not self.busy:
            reformed, reform_msg = self._try_reform()
        elif needs_reform:
            self.group_ok = False
            reform_msg = (f"{rank_label(self.busy)} still busy, so the process group was not "
                          f"re-formed yet: wait and run %dp reform, or %dp restart.")
        summary, report = out.error_report(res, culprits=culprits, waiting=waiting,
                                           timeout_s=self.timeout_s, reform_msg=reform_msg)
        return RemoteCellError(summary, report,
                               failures={r: (o.ename, o.evalue, o.traceback)
                                         for r, o in failures.items()},
                               waiting=waiting, died=died, timed_out=timed_out,
                               reformed=reformed)

    def _try_reform(self) -> tuple[bool, str]:
        try:
            info = self.reform()
        except DpnbError as e:
            self.group_ok = False
            return False, f"Re-forming the process group failed: {e}"
        extra = ""
        if info.get("problems"):
            extra = " Some wrappers could not be re-bound: " + "; ".join(info["problems"])
        return True, (f"The process group was re-formed on port {self.master_port} "
                      f"(generation {self.generation}); everything on the engines is kept.{extra}")

    def reform(self) -> dict:
        """Destroy and re-create the process group on a fresh port.

        Every rank takes part.  User objects stay; wrappers registered by the
        training layer are re-bound to the new group.
        """
        self._check_running()
        if self.dead:
            raise DpnbError(f"{rank_label(self.dead)} died: run %dp restart instead")
        return self._regroup(callbacks=True, hint="; try %dp restart")

    def _regroup(self, *, callbacks: bool, hint: str = "") -> dict:
        """Rank 0 opens a fresh store socket, then every rank re-forms the group."""
        port = self._view(0).apply_sync(_fn("listen_store"), self.master_addr)
        res = self._call_all(_SETUP + ".reform_group", (port, callbacks),
                             timeout=self.timeout_s + 15)
        if not res.ok:
            self.group_ok = False
            raise DpnbError("could not re-form the process group: " + _first_error(res) + hint)
        self.master_port = port
        self.generation = max(o.value["generation"] for o in res.outcomes.values())
        self.group_ok = True
        problems = sorted({p for o in res.outcomes.values() for p in o.value.get("problems", [])})
        return {"port": port, "generation": self.generation, "problems": problems}

    # ------------------------------------------------------------ training
    def wrap(self, model: str = "model", strategy: str = "ddp", **opts) -> dict:
        """Wrap a model that exists on every rank; see :func:`dpnb.train.wrap`."""
        from . import train as _t

        return _t.wrap(self, model, strategy, **opts)

    def set_data(self, dataset: str, **opts) -> dict:
        from . import train as _t

        return _t.set_data(self, dataset, **opts)

    def train(self, **opts) -> dict:
        """Run training steps with live progress; see :func:`dpnb.train.train`."""
        from . import train as _t

        return _t.train(self, **opts)

    def check(self, model: str | None = None) -> dict:
        from . import train as _t

        return _t.check(self, model)

    def save(self, path: str) -> dict:
        from . import train as _t

        return _t.save(self, path)

    def load(self, path: str) -> dict:
        from . import train as _t

        return _t.load(self, path)

    def pull_model(self) -> dict:
        from . import train as _t

        return _t.pull_model(self)

    # ------------------------------------------------------------ push/pull
    def push(self, values: dict, ranks=None) -> None:
        """Copy ``values`` (name -> object) into the namespaces of the ranks."""
        sel = self._select(ranks)
        if not isinstance(values, dict) or not all(isinstance(k, str) and k.isidentifier()
                                                   for k in values):
            raise DpnbError("push takes a dict of name -> value with valid Python names")
        self._finish(self._call_apply(_runner("set_values"), (values,), sel), True)

    def pull(self, name: str, rank: int | None = None):
        """The value of ``name`` on ``rank``, or a list with one value per rank."""
        if not isinstance(name, str) or not name.isidentifier():
            raise DpnbError(f"pull needs a variable name, got {name!r}")
        sel = self._select(None if rank is None else [rank])
        missing = self._call_apply(_runner("has_names"), ([name],), sel)
        self._finish(missing, True)
        lacking = [r for r in sel if missing.outcomes[r].value]
        if lacking:
            have = [r for r in sel if r not in lacking]
            hint = f"; pull it from {rank_label(have)} with --rank {have[0]}" if have else ""
            raise DpnbError(f"{name!r} is not defined on {rank_label(lacking)}{hint}")
        res = self._call_apply(_runner("get_value"), (name,), sel)
        unsendable = [o for o in res.outcomes.values()
                      if o.status == "error" and "serialize" in o.traceback]
        if unsendable:
            raise DpnbError(f"{name!r} cannot be sent to the notebook ({unsendable[0].ename}: "
                            f"{unsendable[0].evalue}); pull plain values such as tensors, "
                            f"numbers or a state_dict (for a wrapped model: %dp pull-model)")
        vals = self._finish(res, True).values
        return vals[0] if rank is not None else vals

    def _call_apply(self, fn, args, sel) -> CellResult:
        ars = {r: self._view(r).apply_async(fn, *args) for r in sel}
        return self._wait(ars, sel, timeout=None, stream=False, kind="apply")

    # --------------------------------------------------------------- status
    def status(self) -> list[dict]:
        """One row per rank: host, pid, device, backend, alive, memory in use."""
        self._check_running()
        self._refresh_busy()
        rows = []
        live = [r for r in range(self.world_size)
                if r not in self.dead and r not in self.busy]
        dead_now = self._find_dead(live)
        for r, how in dead_now.items():
            self.dead[r] = how
        live = [r for r in live if r not in dead_now]
        infos: dict[int, dict] = {}
        if live:
            ars = {r: self._view(r).apply_async(_fn("status")) for r in live}
            for r, ar in ars.items():
                try:
                    infos[r] = ar.get(timeout=10)
                except Exception as e:
                    infos[r] = {"error": f"{type(e).__name__}: {e}"}
        for info in self.ranks:
            r = info.rank
            st = infos.get(r, {})
            alive = r not in self.dead
            rows.append({
                "rank": r,
                "host": info.host,
                "pid": info.pid,
                "engine_id": info.engine_id,
                "device": info.device,
                "backend": self.backend,
                "alive": alive,
                "state": ("dead: " + self.dead[r]) if not alive else
                         ("busy" if r in self.busy else ("ok" if "rss_bytes" in st else
                                                          st.get("error", "?"))),
                "group": st.get("group", None),
                "rss_bytes": st.get("rss_bytes"),
                "cuda_allocated": st.get("cuda_allocated"),
            })
        return rows

    # ----------------------------------------------------------- restart
    def restart(self, *, hard: bool = False, resume: str | None = None) -> str:
        """Replace dead engines and re-form the group; say what was lost.

        Surviving ranks keep their namespaces; a replacement engine takes the
        dead rank's number and starts empty.  ``hard=True`` replaces every
        engine (everything on them is lost).  ``resume=DIR`` then rebuilds the
        training state on every rank: it replays, on all ranks, the cells that
        had run on all ranks and the wrap/data calls (in their order), and
        loads the checkpoint in DIR (model, optimizer, step).
        """
        if resume is not None:
            resume = os.path.abspath(resume)
            if not os.path.isdir(resume):
                raise DpnbError(f"no checkpoint folder at {resume}: give a folder %dp save wrote")
        self._check_running()
        self._refresh_busy()
        survivors_busy = [r for r in self.busy if r not in self.dead]
        if survivors_busy and not hard:
            self._interrupt(survivors_busy)
            deadline = time.monotonic() + self.timeout_s + 10
            while time.monotonic() < deadline:
                self._refresh_busy()
                if not [r for r in self.busy if r not in self.dead]:
                    break
                time.sleep(0.2)
            else:
                hard_ranks = sorted(r for r in self.busy if r not in self.dead)
                for r in hard_ranks:
                    self._kill_rank(r)
                    self.dead[r] = "killed by restart: it did not respond to interrupts"
        self.dead.update(self._find_dead([r for r in range(self.world_size) if r not in self.dead]))
        replace = sorted(range(self.world_size)) if hard else sorted(self.dead)
        if hard:
            for r in replace:
                if r not in self.dead:
                    self._kill_rank(r)
        if replace:
            self._replace_engines(replace)
        self.dead.clear()
        self.busy.clear()
        info = self.reform_all(new=replace)
        kept = [r for r in range(self.world_size) if r not in replace]
        msg = (f"World back to {self.world_size} ranks, process group re-formed on port "
               f"{self.master_port}.")
        if replace:
            msg += f" {rank_label(replace)} replaced: everything defined there was lost."
        if kept:
            msg += f" {_kept(kept)}."
        if info.get("problems"):
            msg += " Not re-bound: " + "; ".join(info["problems"])
        if resume is not None:
            msg += " " + self._resume(resume)
        return msg

    def _resume(self, path: str) -> str:
        from . import train as _t

        log = list(self.setup_log)
        if not any(kind == "wrap" for kind, _ in log):
            raise DpnbError("nothing to resume: no model was wrapped in this cluster's "
                            "history; build and %dp wrap it, then %dp load DIR")
        cells = 0
        for i, (kind, item) in enumerate(log):
            if kind == "cell":
                res = self.run(item, display=False, raise_errors=False)
                if not res.ok:
                    raise DpnbError(f"resume stopped: replaying cell {i + 1} of the history "
                                    f"failed ({_first_error(res)}); fix it and %dp load {path}")
                cells += 1
            elif kind == "wrap":
                _t.wrap(self, item["model"], item["strategy"], **item["opts"])
            elif kind == "data":
                _t.set_data(self, item["dataset"], **item["opts"])
        self.setup_log = log  # replaying must not duplicate the history
        info = _t.load(self, path)
        return (f"Resumed from {path} at step {info.get('step')} after replaying {cells} "
                f"cell{'s' if cells != 1 else ''} and the wrap on every rank.")

    def reform_all(self, new: Sequence[int] = ()) -> dict:
        """Re-form the group when some ranks are fresh engines needing ``init_rank``."""
        port = self.master_port  # replaced below, once rank 0 has its identity
        kernel_pid = os.getpid()
        infos = []
        for r in range(self.world_size):
            ri = self.ranks[r]
            info = dict(rank=r, world_size=self.world_size, local_rank=ri.local_rank,
                        local_world_size=ri.local_world_size, node_rank=ri.node_rank,
                        backend=self.backend,
                        device_index=(int(ri.device.split(":")[1]) if ri.device.startswith("cuda") else None),
                        master_addr=self.master_addr, master_port=port, timeout_s=self.timeout_s,
                        threads=self.threads, local_cluster=self.local,
                        watch_ppid=kernel_pid if (self.local and r in new) else None)
            infos.append(info)
        self._init_ranks(infos)
        return self._regroup(callbacks=not new)

    def _kill_rank(self, r: int) -> None:
        if self.local:
            try:
                os.kill(self.ranks[r].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 10
            while _local_exit(self._ipp, self.ranks[r].pid) is None and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            self.client.shutdown(targets=[self._eid(r)], block=False)

    def _replace_engines(self, ranks: list[int]) -> None:
        known = set(self.client.ids) | {ri.engine_id for ri in self.ranks}
        self._ipp.start_engines_sync(n=len(ranks))
        deadline = time.monotonic() + 120
        while True:
            new = sorted(set(self.client.ids) - known)
            if len(new) >= len(ranks):
                break
            if time.monotonic() > deadline:
                raise StartError(f"replacement engines did not register within 120 s "
                                 f"({len(new)} of {len(ranks)}){_engine_logs(self._ipp)}")
            time.sleep(0.1)
        new = new[: len(ranks)]
        probes = self.client[new].apply_sync(_fn("probe"))
        for r, eid, p in zip(ranks, new, probes):
            old = self.ranks[r]
            self.ranks[r] = RankInfo(rank=r, engine_id=eid, host=p["host"], ip=p["ip"],
                                     pid=p["pid"], local_rank=old.local_rank,
                                     local_world_size=old.local_world_size,
                                     node_rank=old.node_rank, device=old.device)
        if self.local:
            self._write_reaper_pids()

    # ------------------------------------------------------------------ stop
    def stop(self) -> list[int]:
        """Stop every process this cluster started; return the PIDs stopped."""
        if not self.running:
            return []
        self.running = False
        pids = self._owned_pids()
        try:
            self.client.close()
        except Exception:
            pass
        _stop_quietly(self._ipp)
        _wait_pids_gone(pids, 10.0)
        if self._reaper is not None:
            try:
                self._reaper.terminate()
                self._reaper.wait(5)
            except Exception:
                pass
        shutil.rmtree(self.profile_dir, ignore_errors=True)
        return pids

    def _owned_pids(self) -> list[int]:
        """PIDs of the controller, engines and their children (nannies)."""
        try:
            import psutil
        except ImportError:  # psutil comes with ipyparallel
            return [ri.pid for ri in self.ranks]
        pids: set[int] = set()
        roots: list[int] = []
        ctl = getattr(self._ipp, "controller", None)
        if ctl is not None and getattr(ctl, "pid", -1) > 0:
            roots.append(ctl.pid)
        for es in getattr(self._ipp, "engines", {}).values():
            for el in getattr(es, "launchers", {}).values():
                if getattr(el, "pid", -1) > 0:
                    roots.append(el.pid)
            if getattr(es, "pid", -1) > 0:  # mpiexec
                roots.append(es.pid)
        roots += [ri.pid for ri in self.ranks if self.local]
        for pid in roots:
            try:
                p = psutil.Process(pid)
                pids.add(pid)
                pids.update(c.pid for c in p.children(recursive=True))
            except psutil.Error:
                pass
        return sorted(pids)

    def _start_reaper(self) -> None:
        """A tiny watcher that stops our processes if the kernel is SIGKILLed."""
        self._reaper_file = os.path.join(self.profile_dir, "dpnb-pids.txt")
        self._write_reaper_pids()
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "dpnb._reaper", str(os.getpid()), self._reaper_file],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)

    def _write_reaper_pids(self) -> None:
        path = getattr(self, "_reaper_file", None)
        if not path:
            return
        try:
            import psutil

            lines = []
            for pid in self._owned_pids():
                try:
                    lines.append(f"{pid} {psutil.Process(pid).create_time():.3f}")
                except psutil.Error:
                    pass
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write("\n".join(lines) + "\n")
            os.replace(tmp, path)
        except Exception:
            pass

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------- helpers
def assign_ranks(probes: dict[int, dict]) -> list[RankInfo]:
    """Ranks contiguous per host, hosts ordered by their lowest engine id.

    This is torchrun's layout: ``rank = node_rank * local_world_size +
    local_rank`` when hosts run equal numbers of engines, and local rank (and
    so the GPU) comes from the position among the engines on the same host.
    """
    by_host: dict[str, list[int]] = {}
    for eid in sorted(probes):
        by_host.setdefault(probes[eid]["host"], []).append(eid)
    ranks: list[RankInfo] = []
    for node_rank, (host, eids) in enumerate(by_host.items()):
        for local_rank, eid in enumerate(eids):
            p = probes[eid]
            ranks.append(RankInfo(rank=len(ranks), engine_id=eid, host=host, ip=p["ip"],
                                  pid=p["pid"], local_rank=local_rank,
                                  local_world_size=len(eids), node_rank=node_rank, device=""))
    return ranks


def _start_overlapped(icluster, n: int, timeout: float):
    """Start local engines together with the controller, not after it.

    ``start_and_connect`` waits for the controller's connection file before
    it launches engines; then each engine imports ipyparallel, registers,
    and only imports torch when the first call needs it.  Launched through
    :mod:`dpnb.engine.boot`, engines start importing torch and ipyparallel
    while the controller starts, then read the connection file themselves.
    """
    launcher = icluster.config.LocalEngineSetLauncher
    launcher.engine_cmd = [sys.executable, "-m", "dpnb.engine.boot"]
    launcher.environment = {
        **dict(launcher.get("environment", {})),
        "DPNB_CONNECTION_FILE": os.path.join(
            icluster.profile_dir, "security", f"ipcontroller-{icluster.cluster_id}-engine.json"),
        "DPNB_CONNECTION_WAIT": str(timeout),
    }
    icluster.send_engines_connection_env = False
    icluster.start_engines_sync(n)
    icluster.start_controller_sync()
    client = icluster.connect_client_sync()
    client.wait_for_engines(n, timeout=timeout)
    return client


def _fn(name: str):
    from .engine import setup

    return getattr(setup, name)


def _runner(name: str):
    from .engine import runner

    return getattr(runner, name)


def _kept(ranks: Iterable[int]) -> str:
    rs = sorted(ranks)
    return f"{rank_label(rs)} {'keeps its' if len(rs) == 1 else 'keep their'} state"


def _first_error(res: CellResult) -> str:
    for r in res.ranks:
        o = res.outcomes[r]
        if o.status != "ok":
            detail = o.died or f"{o.ename}: {o.evalue}".strip(": ")
            return f"rank {r}: {o.status}: {detail}"
    return "unknown error"


def _local_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _local_exit(icluster, pid: int) -> str | None:
    """None while ``pid`` runs; else how it ended ("exit code 3", "signal 9 (SIGKILL)")."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        p = psutil.Process(pid)
        if p.status() != psutil.STATUS_ZOMBIE:
            return None
    except psutil.NoSuchProcess:
        pass
    code = None
    for es in list(getattr(icluster, "engines", {}).values()):
        launchers = list(getattr(es, "launchers", {}).values())
        stops = list((getattr(es, "stop_data", {}) or {}).get("engines", {}).values())
        for el in launchers:
            if getattr(el, "pid", None) == pid and getattr(el, "process", None) is not None:
                try:
                    code = el.process.wait(0.5)
                except Exception:
                    code = None
        for sd in stops:
            if sd.get("pid") == pid and sd.get("exit_code") is not None:
                code = sd["exit_code"]
    return describe_exit(code)


def describe_exit(code) -> str:
    if code is None:
        return "process gone, exit status unknown"
    code = int(code)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "?"
        hint = " (killed: out of memory or kill -9?)" if -code == signal.SIGKILL else ""
        return f"killed by signal {-code} ({name}){hint}"
    return f"exit code {code}"


def _engine_logs(icluster) -> str:
    try:
        text = "".join(es.get_output() or "" for es in icluster.engines.values())
    except Exception:
        return ""
    text = text.strip()
    return ("\nengine output:\n" + "\n".join(text.splitlines()[-15:])) if text else ""


def _stop_quietly(icluster) -> None:
    try:
        icluster.stop_cluster_sync()
    except Exception:
        pass


def _wait_pids_gone(pids: list[int], timeout: float) -> None:
    """Wait for ``pids`` to exit, SIGKILLing (by PID) whatever outlives ``timeout``."""
    try:
        import psutil
    except ImportError:
        return
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def _apply_launcher_args(icluster, engines: str, args: Sequence[str]) -> None:
    """Pass launcher settings through to ipyparallel.

    slurm: ``KEY=VALUE`` for ``SlurmEngineSetLauncher`` traits (``queue``
    (the partition), ``account``, ``timelimit``, ``qos``, ``options``);
    ssh: ``HOST=N`` engines per host.
    """
    pairs = []
    for a in args:
        key, sep, value = a.partition("=")
        if not sep or not key:
            raise DpnbError(f"--launcher-arg {a!r}: use KEY=VALUE for {engines} "
                            f"(e.g. {'queue=gpu' if engines == 'slurm' else 'node1=4'})")
        pairs.append((key.strip(), value.strip()))
    if engines == "slurm":
        allowed = {"queue", "account", "timelimit", "qos", "options"}
        for key, value in pairs:
            if key not in allowed:
                raise DpnbError(f"--launcher-arg {key}=...: slurm takes {', '.join(sorted(allowed))}")
            setattr(icluster.config.SlurmEngineSetLauncher, key, value)
    elif engines == "ssh":
        try:
            icluster.config.SSHEngineSetLauncher.engines = {h: int(n) for h, n in pairs}
        except ValueError:
            raise DpnbError("--launcher-arg for ssh is HOST=N (engines on that host)") from None
    else:
        raise DpnbError(f"the {engines} launcher takes no --launcher-arg")

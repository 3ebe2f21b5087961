"""The launcher interface and what launchers of a kind share (see :mod:`dpnb.cluster.launchers`)."""

from __future__ import annotations

import collections
import logging
import os
import signal
import time
from collections.abc import Iterable, Sequence
from typing import ClassVar

from ...errors import DpnbError
from ..processes import Spawned, stop_ipp, terminate, wait_pids_gone
from ..sidedoor import is_closed
from ..spares import Spares
from ..types import LaunchSpec, RankInfo

log = logging.getLogger(__name__)

#: a CPU host runs at most this many engines per core (8 on a laptop's 2):
#: beyond it every step crawls and the group timeout fires
ENGINES_PER_CORE = 4
#: how often :meth:`EngineLauncher.wait_exit` asks whether an engine has ended
EXIT_POLL_S = 0.05


class EngineLauncher:
    """One way of running engines; subclasses say how (see the module)."""

    name: ClassVar[str] = ""
    #: engines are this process's descendants on this host: their PIDs are ours
    engines_here: ClassVar[bool] = False
    #: an engine's exit is seen as it happens (here, or by its host agent);
    #: otherwise only the controller's heartbeat notices, up to 30 s later
    sees_exits: ClassVar[bool] = False
    #: the launcher's own rank (Slurm's task id, MPI's world rank) orders the ranks
    by_launch_rank: ClassVar[bool] = False
    #: what ipyparallel's ``engines=`` is for this launcher
    ipp_engines: ClassVar[str] = ""
    #: its agents fork engines on demand, so it can keep spares (``--spares``)
    keeps_spares: ClassVar[bool] = False

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.agents = None  # dpnb.cluster.agents.Agents, for launchers that start host agents
        # what it started: ipyparallel's cluster (controller, engine sets) and its client
        self.ipp = None
        self.client = None
        self.spawned: Spawned | None = None
        self.spares: Spares | None = None  # --spares: engines kept ready beside the ranks

    def begin(self) -> None:
        """Before its first process: what runs below this one already is not its,
        so a start failing at any step stops exactly what it spawned
        (:class:`~dpnb.cluster.processes.Spawned`, :func:`dpnb.cluster.launch.tear_down`)."""
        self.spawned = Spawned()

    def bind(self, icluster, client) -> None:
        """Hold the ipyparallel cluster and client its processes answer through."""
        self.ipp, self.client = icluster, client

    # ------------------------------------------------------------------ start
    def check_start(self, n: int) -> None:
        """Refuse a start that cannot work, before anything starts: ``--keep``
        with engines this kernel's connections hold, and the launcher's own settings."""
        if self.spec.kept and not self.engines_here:
            raise DpnbError(f"--keep works with local engines; the {self.spec.engines} "
                            f"launcher's engines are held by this kernel's connections")
        if self.spec.spares < 0:
            raise DpnbError(f"--spares {self.spec.spares}: give a count of 0 or more spare "
                            f"engines per host")
        if self.spec.spares and not self.keeps_spares:
            raise DpnbError(f"--spares needs engines that dpnb's host agents fork (local "
                            f"engines without --no-zygote or --keep, or --engines ssh); this "
                            f"{self.name} launcher starts its engines otherwise: leave --spares out")
        self.check(n)

    def master_addr(self, ranks: Sequence[RankInfo]) -> str:
        """The group's store address: the user's ``--master-addr``, else loopback for
        engines on this host, else rank 0's address on its route to the controller."""
        return self.spec.master_addr or ("127.0.0.1" if self.engines_here else ranks[0].ip)

    def check(self, n: int) -> None:
        """Refuse launcher settings that cannot work, before anything starts."""
        if self.spec.launcher_args:
            raise DpnbError(f"the {self.name} launcher takes no --launcher-arg")

    def configure(self, icluster, profile_dir: str) -> None:
        """Set ipyparallel's launcher up (before the controller starts)."""

    def controller_ip(self) -> str:
        """Where the controller listens (the user's ``--controller-ip`` wins)."""
        return self.spec.controller_ip or self._controller_ip()

    def _controller_ip(self) -> str:
        return "*"

    def start(self, icluster, n: int, timeout: float, warm=None):
        """Start the controller and ``n`` engines; the connected client."""
        return icluster.start_and_connect_sync(n=n)

    def rank_order(self, n: int) -> dict:
        """How :func:`dpnb.cluster.placement.assign_ranks` orders the engines."""
        return {"by_launch_rank": self.by_launch_rank}

    @property
    def watch_kernel(self) -> bool:
        """Engines end when this kernel does (a kept cluster's, and agent-held
        engines, whose agent ends them, do not watch it)."""
        return self.agents is None and not self.spec.kept

    def watched_kernel(self) -> int | None:
        """The PID its freshly started engines watch (``init_rank``'s
        ``watch_ppid``): this kernel, for engines it started on this host and
        that :attr:`watch_kernel`; None for the others."""
        return os.getpid() if self.engines_here and self.watch_kernel else None

    # -------------------------------------------------------------------- run
    def capacity(self, ranks: Sequence[RankInfo], backend: str,
                 gpus: list[int] | None) -> tuple[int, str]:
        """How many ranks this launcher can place, and why that many."""
        return len(ranks), (f"the {self.name} launcher placed its engines once; resize can "
                            f"shrink this cluster, and grow it only back to its start size")

    def keep_spares(self, ranks: Sequence[RankInfo]) -> None:
        """Start the spares ``--spares`` asks for beside ``ranks`` (:mod:`..spares`);
        only launchers that :attr:`keeps_spares` have any (checked at the start)."""

    def remember(self, ranks: Iterable[RankInfo]) -> None:
        """Note a new rank table: what a later kill needs of its engines (local
        ones: their start times), and that none of them is a spare."""
        if self.spares is not None:
            self.spares.saw(ranks)

    def start_more(self, ranks: Sequence[RankInfo], k: int) -> dict | None:
        """Start ``k`` more engines (a resize that grows); what the agents started, if any."""
        self.ipp.start_engines_sync(n=k)
        return None

    def start_replacements(self, ranks: Sequence[RankInfo], dead: list[int]) -> dict | None:
        """Start one engine per dead rank of ``dead``, where the launcher can place it."""
        self.ipp.start_engines_sync(n=len(dead))
        return None

    def exit_of(self, ri: RankInfo, door: tuple[str, int] | None) -> str | None:
        """How rank ``ri``'s engine ended, or None while it runs: here, engines this
        host cannot see, so as the controller and the engine's side door tell."""
        if ri.engine_id not in set(self.client.ids):
            return "its engine unregistered from the controller"
        if door is not None and is_closed(*door):
            return f"its engine on {ri.host} is gone (nothing listens at its side door)"
        return None

    def wait_exit(self, ri: RankInfo, door: tuple[str, int] | None, wait_s: float) -> str | None:
        """:meth:`exit_of`, asked every ``EXIT_POLL_S`` until it says how the engine
        ended or ``wait_s`` has passed (then None): an exit is reported -- reaped
        here, or an agent's report -- a moment after it happens."""
        deadline = time.monotonic() + wait_s
        while True:
            how = self.exit_of(ri, door)
            if how is not None or time.monotonic() >= deadline:
                return how
            time.sleep(EXIT_POLL_S)

    def frozen_states(self, ris: Sequence[RankInfo]) -> dict[tuple[str, int], str]:
        """``{(location, pid): psutil status}`` of the engines of ``ris`` (on other
        hosts) that are stopped or held by a tracer -- keyed by host too, since two
        hosts' PID spaces are their own; here nobody on those hosts can say, so {}."""
        return {}

    def kill(self, ri: RankInfo) -> None:
        """Stop rank ``ri``'s engine for good: the controller tells its nanny."""
        self.client.shutdown(targets=[ri.engine_id], block=False)

    def interrupt(self, ris: list[RankInfo]) -> None:
        """SIGINT to these ranks' engines, relayed by the controller."""
        try:
            self.client.send_signal(signal.SIGINT, targets=[ri.engine_id for ri in ris],
                                    block=False)
        except Exception as e:  # the controller relays signals; say it did not
            log.warning("interrupting ranks %s through the controller failed: %s",
                        [ri.rank for ri in ris], e)

    def describe(self) -> str:
        return f"{self.name} launcher"

    # ---------------------------------------------------------- its processes
    def root_pids(self, ranks: Iterable[RankInfo]) -> list[int]:
        """This host's processes it started, whose descendants are the cluster's:
        the controller (engines elsewhere are never stopped by a PID here)."""
        ctl = getattr(self.ipp, "controller", None)
        return [ctl.pid] if ctl is not None and getattr(ctl, "pid", -1) > 0 else []

    def stop(self, owned: dict[int, float]) -> None:
        """Stop everything it started: ``owned`` (this host's processes of the
        cluster, ``{pid: start time}``) SIGTERMed at once but the controller and
        the host agents, the agents closed (every host at once), ipyparallel's
        stop of the controller; what outlives 10 s gets SIGKILL."""
        try:
            self.client.close()
        except Exception as e:  # the sockets go with the process anyway
            log.info("closing the ipyparallel client: %s: %s", type(e).__name__, e)
        terminate(owned, self.stops_itself())
        self.close()
        stop_ipp(self.ipp)
        wait_pids_gone(owned, 10.0)

    def stops_itself(self) -> set[int]:
        """Of :meth:`root_pids`, those answering their own stop (not SIGTERMed with the engines)."""
        return {getattr(getattr(self.ipp, "controller", None), "pid", None)}

    def to_record(self) -> dict:
        """What a kept cluster's record holds of its launcher: the engines'
        environment (a kept cluster's engines are local: :func:`.from_record`)."""
        return {"env": [list(kv) for kv in self.spec.env]}

    def close(self) -> None:
        """End the host agents (every host at once: SIGTERM, then SIGKILL), if any."""
        if self.agents is not None:
            self.agents.close()


def ipp_launcher_pids(icluster) -> list[int]:
    """The PIDs of ipyparallel's launcher processes (engines' nannies, mpiexec) here."""
    out = []
    for es in getattr(icluster, "engines", {}).values():
        out += [el.pid for el in getattr(es, "launchers", {}).values()
                if getattr(el, "pid", -1) > 0]
        if getattr(es, "pid", -1) > 0:  # mpiexec
            out.append(es.pid)
    return out


class AgentLauncher(EngineLauncher):
    """Engines forked by dpnb's host agents (:mod:`dpnb.cluster.agents`): each
    engine's exit is seen at once, and its agent signals it."""

    sees_exits = True
    keeps_spares = True

    def keep_spares(self, ranks: Sequence[RankInfo]) -> None:
        if not self.spec.spares:
            return
        agents = self.agents
        self.spares = Spares(self.spec.spares, agents.start,
                             lambda loc, pid: agents.exit_of(loc, pid) is None)
        self.spares.saw(ranks)
        self.spares.fill(ri.location for ri in ranks)

    def start_more(self, ranks: Sequence[RankInfo], k: int) -> dict | None:
        return self.agents.start(self._free_slots(ranks, k))

    def _free_slots(self, ranks: Sequence[RankInfo], k: int) -> dict[str, int]:
        used = collections.Counter(ri.location for ri in ranks)
        counts: dict[str, int] = {}
        for host, slots in self.agents.counts.items():
            take = min(slots - used.get(host, 0), k - sum(counts.values()))
            if take > 0:
                counts[host] = take
        return counts

    def start_replacements(self, ranks: Sequence[RankInfo], dead: list[int]) -> dict | None:
        return self.agents.start(dict(collections.Counter(ranks[r].location for r in dead)))

    def exit_of(self, ri: RankInfo, door: tuple[str, int] | None) -> str | None:
        return self.agents.exit_of(ri.location, ri.pid)

    def signal(self, ri: RankInfo, sig: int, wait_s: float = 0.0) -> bool:
        """Signal an agent-hosted engine through its host's agent (never by a local PID)."""
        sent = self.agents.signal(ri.location, ri.pid, sig)
        if sent and wait_s:
            self.wait_exit(ri, None, wait_s)
        return sent

    def frozen_states(self, ris: Sequence[RankInfo]) -> dict[tuple[str, int], str]:
        """Asked of each host's agent, which reads its engines' states there."""
        by_host: dict[str, list[int]] = collections.defaultdict(list)
        for ri in ris:
            by_host[ri.location].append(ri.pid)
        return {(host, pid): how for host, pids in by_host.items()
                for pid, how in self.agents.states(host, pids).items()}

    def kill(self, ri: RankInfo) -> None:
        self.signal(ri, signal.SIGKILL, wait_s=10.0)

    def interrupt(self, ris: list[RankInfo]) -> None:
        for ri in ris:
            self.signal(ri, signal.SIGINT)

    def root_pids(self, ranks: Iterable[RankInfo]) -> list[int]:
        # the agents' ssh clients (or the zygote): ending them ends the agents
        return super().root_pids(ranks) + self.agents.local_pids()

    def stops_itself(self) -> set[int]:
        # agents answer their own "stop" (and reap what they forked)
        return super().stops_itself() | set(self.agents.local_pids())


def gpu_capacity(ranks: Sequence[RankInfo], per_host: int) -> tuple[int, str]:
    """Under NCCL: one GPU per rank, ``per_host`` GPUs on each of the cluster's hosts."""
    hosts = {r.host for r in ranks}
    return per_host * len(hosts), f"one GPU per rank, {per_host} per host"


def cpu_capacity() -> tuple[int, str]:
    cores = os.cpu_count() or 1
    return ENGINES_PER_CORE * cores, (f"{ENGINES_PER_CORE} CPU engines per core on this "
                                      f"host's {cores} cores")

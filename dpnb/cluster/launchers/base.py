"""The launcher interface and what launchers of a kind share (see :mod:`dpnb.cluster.launchers`)."""

from __future__ import annotations

import collections
import logging
import os
import signal
from typing import TYPE_CHECKING, ClassVar

from ...errors import DpnbError
from ..types import LaunchSpec, RankInfo

if TYPE_CHECKING:  # pragma: no cover
    from .. import Engines
    from ..processes import Processes

log = logging.getLogger(__name__)

#: a CPU host runs at most this many engines per core (8 on a laptop's 2):
#: beyond it every step crawls and the group timeout fires
ENGINES_PER_CORE = 4


class EngineLauncher:
    """One way of running engines; subclasses say how (see the module)."""

    name: ClassVar[str] = ""
    #: engines are this process's descendants on this host: their PIDs are ours
    engines_here: ClassVar[bool] = False
    #: ipyparallel's launcher processes (nannies, mpiexec) run on this host
    launcher_processes_here: ClassVar[bool] = False
    #: the launcher's own rank (Slurm's task id, MPI's world rank) orders the ranks
    by_launch_rank: ClassVar[bool] = False
    #: what ipyparallel's ``engines=`` is for this launcher
    ipp_engines: ClassVar[str] = ""

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.agents = None  # dpnb.cluster.agents.Agents, for launchers that start host agents

    # ------------------------------------------------------------------ start
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

    # -------------------------------------------------------------------- run
    def capacity(self, c: Engines) -> tuple[int, str]:
        """How many ranks this launcher can place, and why that many."""
        return c.world_size, (f"the {self.name} launcher placed its engines once; resize can "
                              f"shrink this cluster, and grow it only back to its start size")

    def start_more(self, c: Engines, k: int) -> dict | None:
        """Start ``k`` more engines (a resize that grows); what the agents started, if any."""
        c._ipp.start_engines_sync(n=k)
        return None

    def start_replacements(self, c: Engines, ranks: list[int]) -> dict | None:
        """Start one engine per dead rank of ``ranks``, where the launcher can place it."""
        c._ipp.start_engines_sync(n=len(ranks))
        return None

    def kill(self, c: Engines, ri: RankInfo) -> None:
        """Stop rank ``ri``'s engine for good: the controller tells its nanny."""
        c.client.shutdown(targets=[ri.engine_id], block=False)

    def interrupt(self, procs: Processes, client, ris: list[RankInfo]) -> None:
        """SIGINT to these ranks' engines, relayed by the controller."""
        try:
            client.send_signal(signal.SIGINT, targets=[ri.engine_id for ri in ris], block=False)
        except Exception as e:  # the controller relays signals; say it did not
            log.warning("interrupting ranks %s through the controller failed: %s",
                        [ri.rank for ri in ris], e)

    def describe(self) -> str:
        return f"{self.name} launcher"

    def close(self) -> None:
        """End the host agents (every host at once: SIGTERM, then SIGKILL), if any."""
        if self.agents is not None:
            self.agents.close()


class AgentLauncher(EngineLauncher):
    """Engines forked by dpnb's host agents (:mod:`dpnb.cluster.agents`): each
    engine's exit is seen at once, and its agent signals it."""

    def start_more(self, c: Engines, k: int) -> dict | None:
        return self.agents.start(self._free_slots(c, k))

    def _free_slots(self, c: Engines, k: int) -> dict[str, int]:
        used = collections.Counter(ri.location for ri in c.ranks)
        counts: dict[str, int] = {}
        for host, slots in self.agents.counts.items():
            take = min(slots - used.get(host, 0), k - sum(counts.values()))
            if take > 0:
                counts[host] = take
        return counts

    def start_replacements(self, c: Engines, ranks: list[int]) -> dict | None:
        return self.agents.start(dict(collections.Counter(c.ranks[r].location for r in ranks)))

    def kill(self, c: Engines, ri: RankInfo) -> None:
        c.procs.signal_remote(ri, signal.SIGKILL, wait_s=10.0)

    def interrupt(self, procs: Processes, client, ris: list[RankInfo]) -> None:
        for ri in ris:
            procs.signal_remote(ri, signal.SIGINT)


def gpu_capacity(c: Engines, per_host: int) -> tuple[int, str]:
    """Under NCCL: one GPU per rank, ``per_host`` GPUs on each of the cluster's hosts."""
    hosts = {r.host for r in c.ranks}
    return per_host * len(hosts), f"one GPU per rank, {per_host} per host"


def cpu_capacity() -> tuple[int, str]:
    cores = os.cpu_count() or 1
    return ENGINES_PER_CORE * cores, (f"{ENGINES_PER_CORE} CPU engines per core on this "
                                      f"host's {cores} cores")

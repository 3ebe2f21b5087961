"""Engines on this host: one Python per engine, or forked from one zygote.

Both listen on loopback only, and their engines are this process's
descendants, so a kill or an interrupt goes to the PID (checked against its
start time, never a recycled one).  The zygote (:mod:`dpnb.engine.hostagent`
on this host) imports torch once and forks the engines; it also reports each
exit at once, as the ssh agents do.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Sequence

from .. import agents as agents_mod
from ..registration import wait_registered
from dpnb.engine import entrypoints as ep
from ..processes import ended, local_exit, same_process, start_time
from ..types import RankInfo
from .base import (EXIT_POLL_S, AgentLauncher, EngineLauncher, cpu_capacity, gpu_capacity,
                   ipp_launcher_pids)

log = logging.getLogger(__name__)

#: how long an engine seen ended here waits for the zygote's report of how
#: (it reaps and reports within milliseconds; a busy host, longer)
REPORT_WAIT_S = 1.0


def preload_setting(n: int, cores: int) -> str:
    """What local engines preload while the cluster starts: everything the first
    wrap needs (``all``), or -- more engines than cores -- ``torch`` only: the
    background preload of DDP/FSDP/dynamo would compete with the start itself."""
    return "all" if n <= cores else "torch"


def local_gpu_count() -> int:
    """GPUs this host's processes see (the engines' own count, asked here)."""
    from dpnb.engine.device import device_count  # imports torch: only for --backend nccl

    return device_count()


class LocalLauncher(EngineLauncher):
    """ipyparallel's ``LocalEngineSetLauncher``, engines started through
    :mod:`dpnb.engine.boot` together with the controller."""

    name = "local"
    ipp_engines = "local"
    engines_here = True
    sees_exits = True

    def __init__(self, spec):
        super().__init__(spec)
        self._started: dict[int, float | None] = {}  # engine pid -> start time

    def configure(self, icluster, profile_dir: str) -> None:
        icluster.config.LocalEngineSetLauncher.environment = self.spec.env_dict

    def _controller_ip(self) -> str:
        return "127.0.0.1"

    def start(self, icluster, n: int, timeout: float, warm=None):
        """Start local engines together with the controller, not after it.

        ``start_and_connect`` waits for the controller's connection file
        before it launches engines; launched through :mod:`dpnb.engine.boot`,
        engines import torch and ipyparallel while the controller starts,
        then read the connection file themselves.
        """
        from dpnb.engine.proc.preload import PRELOAD_ENV  # imports torch: the start's own import

        launcher = icluster.config.LocalEngineSetLauncher
        launcher.engine_cmd = [sys.executable, "-m", ep.BOOT_MODULE]
        launcher.environment = {
            **dict(launcher.get("environment", {}) or {}),
            "DPNB_CONNECTION_FILE": agents_mod.engine_connection_file(icluster),
            "DPNB_CONNECTION_WAIT": str(timeout),
            PRELOAD_ENV: preload_setting(n, os.cpu_count() or 1),
        }
        icluster.send_engines_connection_env = False
        icluster.start_engines_sync(n)
        icluster.start_controller_sync()
        return wait_registered(icluster, icluster.connect_client_sync(), n, timeout,
                               lambda: _stopped_sets(icluster))

    def capacity(self, ranks: Sequence[RankInfo], backend: str,
                 gpus: list[int] | None) -> tuple[int, str]:
        if backend == "nccl":
            return gpu_capacity(ranks, len(gpus) if gpus else local_gpu_count())
        return cpu_capacity()

    def remember(self, ranks: Iterable[RankInfo]) -> None:
        """Note each engine's start time, so a kill never hits a recycled PID."""
        ranks = list(ranks)
        super().remember(ranks)
        for ri in ranks:
            self._started.setdefault(ri.pid, start_time(ri.pid))

    def exit_of(self, ri: RankInfo, door: tuple[str, int] | None) -> str | None:
        return local_exit(self.ipp, ri.pid)

    def kill(self, ri: RankInfo, wait_s: float = 10.0) -> None:
        """SIGKILL by PID on this host, then wait until it is reaped."""
        if not same_process(ri.pid, self._started.get(ri.pid)):
            log.info("rank %s: pid %s is gone or recycled; nothing to kill", ri.rank, ri.pid)
            return
        try:
            os.kill(ri.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.wait_exit(ri, None, wait_s)

    def interrupt(self, ris: list[RankInfo]) -> None:
        for ri in ris:
            if same_process(ri.pid, self._started.get(ri.pid)):
                try:
                    os.kill(ri.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass

    def root_pids(self, ranks: Iterable[RankInfo]) -> list[int]:
        """The controller, the engines' nannies and the engines themselves."""
        return super().root_pids(ranks) + ipp_launcher_pids(self.ipp) + [ri.pid for ri in ranks]


def _stopped_sets(icluster) -> list[str]:
    """ipyparallel's engine sets that ended before registering (what its own
    ``wait_for_engines`` ended on)."""
    return [f"engine set {name} stopped: {es.stop_data}"
            for name, es in (icluster.engines or {}).items() if es.state == "after"]


class ZygoteAgent(agents_mod.Agents):
    """The one agent of a local zygote cluster: on this host, forking its engines
    (the same protocol and bookkeeping as the ssh agents: exits reported at once,
    signals and stops only for its own engines, engines exit if it dies)."""

    EXIT_ON, ENDED = "", "the zygote agent on this host ended"

    def _agent(self, h: str, warm) -> agents_mod.HostAgent:
        taken = warm.take() if warm is not None else None  # one imported torch ahead
        if taken is not None:
            return taken
        return agents_mod.HostAgent(h, [self.remote_python, "-m", ep.HOSTAGENT_MODULE,
                                        "--zygote"])

    def _environ(self) -> dict[str, str] | None:
        return dict(os.environ)  # its engines take this kernel's environment as it is now


class ZygoteLauncher(LocalLauncher, AgentLauncher):
    """Local engines forked from one zygote agent that imported torch once.

    The agent starts more engines and reports their exits, as for ssh; kills
    and interrupts stay by PID (LocalLauncher's, first in the order: the
    engines are this host's processes)."""

    def start(self, icluster, n: int, timeout: float, warm=None):
        """An agent on this host imports torch once, while the controller
        starts, then forks the ``n`` engines (``warm``: one started ahead)."""
        agents = ZygoteAgent({agents_mod.ZYGOTE_HOST: n}, remote_python=sys.executable,
                             ssh_config=None, env=self.spec.env_dict, zygote="on")
        client, self.agents = agents_mod.start_with(agents, icluster, n, timeout, warm)
        return client

    def _free_slots(self, ranks: Sequence[RankInfo], k: int) -> dict[str, int]:
        return {agents_mod.ZYGOTE_HOST: k}  # one host, as many as asked (capacity said how many)

    # kills and interrupts by PID, as LocalLauncher's.  Its processes:
    # LocalLauncher's, and (next in the order) the zygote's own

    def exit_of(self, ri: RankInfo, door: tuple[str, int] | None) -> str | None:
        """How the engine ended, as the zygote reported; and, before its report,
        as this host sees the PID.

        Why both: the zygote reaps a fork and reports its exit a moment after
        the death, and the controller lists the engine until its heartbeats
        have been missed for seconds.  A restart asked in that moment (an
        engine SIGKILLed from a terminal, then ``%dp restart`` at once) saw a
        live rank, kept it, and failed when the group formed.  The engine is
        this host's process: ended (a zombie the zygote has not reaped yet,
        gone, or its PID taken by another process) is dead, and the zygote's
        report, waited for briefly, says how."""
        how = AgentLauncher.exit_of(self, ri, door)
        started = self._started.get(ri.pid)  # None: never noted as a rank's engine
        if how is not None or started is None or not ended(ri.pid, started):
            return how
        deadline = time.monotonic() + REPORT_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(EXIT_POLL_S)
            how = AgentLauncher.exit_of(self, ri, door)
            if how is not None:
                return how
        return "its engine process ended (the zygote has not reported how yet)"

    def describe(self) -> str:
        return "local launcher (engines forked from one zygote)"

"""Engines on this host: one Python per engine, or forked from one zygote.

Both listen on loopback only, and their engines are this process's
descendants, so a kill or an interrupt goes to the PID (checked against its
start time, never a recycled one).  The zygote (:mod:`dpnb.engine.hostagent`
on this host) imports torch once and forks the engines; it also reports each
exit at once, as the ssh agents do.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from .. import agents as agents_mod
from ...engine import entrypoints as ep
from .base import AgentLauncher, EngineLauncher, cpu_capacity, gpu_capacity

if TYPE_CHECKING:  # pragma: no cover
    from .. import Engines
    from ..processes import Processes
    from ..types import RankInfo


def preload_setting(n: int, cores: int) -> str:
    """What local engines preload while the cluster starts: everything the first
    wrap needs (``all``), or -- more engines than cores -- ``torch`` only: the
    background preload of DDP/FSDP/dynamo would compete with the start itself."""
    return "all" if n <= cores else "torch"


def local_gpu_count() -> int:
    """GPUs this host's processes see (the engines' own count, asked here)."""
    from ...engine.device import device_count  # imports torch: only for --backend nccl

    return device_count()


class LocalLauncher(EngineLauncher):
    """ipyparallel's ``LocalEngineSetLauncher``, engines started through
    :mod:`dpnb.engine.boot` together with the controller."""

    name = "local"
    ipp_engines = "local"
    engines_here = True
    launcher_processes_here = True

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
        from ...engine.setup import PRELOAD_ENV  # imports torch: the start's own import

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
        client = icluster.connect_client_sync()
        client.wait_for_engines(n, timeout=timeout)
        return client

    def capacity(self, c: Engines) -> tuple[int, str]:
        if c.backend == "nccl":
            return gpu_capacity(c, len(c.gpus) if c.gpus else local_gpu_count())
        return cpu_capacity()

    def kill(self, c: Engines, ri: RankInfo) -> None:
        """SIGKILL by PID on this host, then wait until it is reaped."""
        c.procs.kill_local(ri)

    def interrupt(self, procs: Processes, client, ris: list[RankInfo]) -> None:
        for ri in ris:
            procs.interrupt_local(ri)


class ZygoteLauncher(LocalLauncher, AgentLauncher):
    """Local engines forked from one zygote agent that imported torch once.

    The agent starts more engines and reports their exits, as for ssh; kills
    and interrupts stay by PID (LocalLauncher's, first in the order: the
    engines are this host's processes)."""

    def start(self, icluster, n: int, timeout: float, warm=None):
        client, self.agents = agents_mod.start_zygote(icluster, n, self.spec, timeout, warm)
        return client

    def _free_slots(self, c: Engines, k: int) -> dict[str, int]:
        return {agents_mod.ZYGOTE_HOST: k}  # one host, as many as asked (capacity said how many)

    def describe(self) -> str:
        return "local launcher (engines forked from one zygote)"

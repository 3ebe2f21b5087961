"""Engines on other hosts over ssh: one host agent per host, ``HOST=N`` slots each.

ipyparallel itself starts nothing here (its ``engines`` setting is
``local`` only to satisfy it); each host's agent (:mod:`dpnb.cluster.agents`,
remote side :mod:`dpnb.engine.hostagent`) forks that host's engines, reports
their exits at once and signals them.  The ranks follow the hosts in the
order the user gave them.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Sequence

from ...errors import DpnbError
from .. import agents as agents_mod
from ..types import RankInfo
from .base import AgentLauncher, gpu_capacity


def local_address_towards(addr: str) -> str:
    """This host's address on the route to ``addr`` (a UDP connect sends nothing)."""

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        return s.getsockname()[0]


class SshLauncher(AgentLauncher):
    name = "ssh"
    ipp_engines = "local"

    def check(self, n: int) -> None:
        agents_mod.parse_hosts(n, self.spec.launcher_args)  # bad hosts fail before anything starts
        if shutil.which("ssh") is None:  # hosted servers often ship without a client
            raise DpnbError("the ssh launcher needs an ssh client on PATH and there is none "
                            "here: install openssh-client, or start local engines (%dp start -n N)")

    def _controller_ip(self) -> str:
        """This host's address on the route to the first host, so the engines
        reach it whatever this host's name resolves to."""
        first = self.spec.launcher_args[0].partition("=")[0].strip()  # checked by parse_hosts
        return local_address_towards(agents_mod.resolve(first, self.spec.ssh_config))

    def start(self, icluster, n: int, timeout: float, warm=None):
        client, self.agents = agents_mod.start_over_ssh(icluster, n, self.spec, timeout)
        return client

    def rank_order(self, n: int) -> dict:
        return {"host_order": list(agents_mod.parse_hosts(n, self.spec.launcher_args))}

    def capacity(self, ranks: Sequence[RankInfo], backend: str,
                 gpus: list[int] | None) -> tuple[int, str]:
        if backend == "nccl":
            return gpu_capacity(ranks, len(gpus) if gpus else
                                max(r.local_world_size for r in ranks))
        return sum(self.agents.counts.values()), "the HOST=N slots given to --launcher-arg"

"""Launchers as classes: how each kind of launcher starts, places, replaces,
signals and stops engines.

ipyparallel gives each launcher a class (``LocalEngineSetLauncher``,
``MPIEngineSetLauncher``, ``SlurmEngineSetLauncher``); dpnb's launchers wrap
those and its own host agents behind one interface, so nothing else in the
runtime asks a launcher's name:

* **start**: :meth:`EngineLauncher.configure` the ipyparallel cluster,
  :meth:`~EngineLauncher.controller_ip` (where the engines can reach the
  controller), :meth:`~EngineLauncher.start` the controller and ``n``
  engines, :meth:`~EngineLauncher.rank_order` (how the engines become ranks);
* **run**: :meth:`~EngineLauncher.capacity` (how many ranks a resize may
  ask for), :meth:`~EngineLauncher.start_more` (grow),
  :meth:`~EngineLauncher.start_replacements` (restart: on the dead ranks'
  hosts), :meth:`~EngineLauncher.kill` and :meth:`~EngineLauncher.interrupt`
  one rank's engine, :meth:`~EngineLauncher.exit_of` (how it ended),
  :meth:`~EngineLauncher.describe`;
* **own**: from its first process on (:meth:`~EngineLauncher.begin`, then
  :meth:`~EngineLauncher.bind` to ipyparallel's cluster and client) a launcher
  owns what it started: which of this host's PIDs are the cluster's
  (:meth:`~EngineLauncher.root_pids`), :meth:`~EngineLauncher.stop`, and its
  part of a kept cluster's record (:meth:`~EngineLauncher.to_record`,
  :func:`from_record`); a start failing at any step stops what it spawned.

Who signals an engine follows who started it: this process, by PID and start
time, for local engines (:mod:`.local`); the host's agent for ssh and zygote
engines (:mod:`dpnb.cluster.agents`); the controller, which relays to the
engine's nanny, for Slurm and MPI engines on nodes this host cannot see
(:mod:`.batch`).
"""

from __future__ import annotations

from ...errors import DpnbError
from ..types import LaunchSpec
from .base import EngineLauncher
from .slurm_mpi import MpiLauncher, SlurmLauncher
from .local import LocalLauncher, ZygoteLauncher
from .ssh import SshLauncher

__all__ = ["EngineLauncher", "launcher_for"]

_KINDS: dict[str, type[EngineLauncher]] = {"ssh": SshLauncher, "slurm": SlurmLauncher,
                                           "mpi": MpiLauncher}


def from_record(rec: dict) -> EngineLauncher:
    """The launcher of a kept cluster (:meth:`EngineLauncher.to_record`): local
    engines, the only ones a cluster may be kept with."""
    return launcher_for(LaunchSpec(env=tuple(tuple(kv) for kv in rec["env"]), kept=True))


def launcher_for(spec: LaunchSpec) -> EngineLauncher:
    """The launcher ``spec`` asks for."""
    if spec.engines == "local":
        return ZygoteLauncher(spec) if spec.zygote else LocalLauncher(spec)
    if spec.engines not in _KINDS:
        raise DpnbError(f"unknown launcher {spec.engines!r}: choose one of local, "
                        f"{', '.join(_KINDS)}")
    return _KINDS[spec.engines](spec)

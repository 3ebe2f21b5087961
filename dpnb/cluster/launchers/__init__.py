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
  one rank's engine, :meth:`~EngineLauncher.describe`.

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


def launcher_for(spec: LaunchSpec) -> EngineLauncher:
    """The launcher ``spec`` asks for."""
    if spec.engines == "local":
        return ZygoteLauncher(spec) if spec.zygote else LocalLauncher(spec)
    if spec.engines not in _KINDS:
        raise DpnbError(f"unknown launcher {spec.engines!r}: choose one of local, "
                        f"{', '.join(_KINDS)}")
    return _KINDS[spec.engines](spec)

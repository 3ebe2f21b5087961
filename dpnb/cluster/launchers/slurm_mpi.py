"""Engines started by a batch system on nodes this host may not see: Slurm and MPI.

ipyparallel's ``SlurmEngineSetLauncher`` / ``MPIEngineSetLauncher`` run
``srun`` / ``mpiexec`` with :mod:`dpnb.engine.boot` as the engine command.
The launcher numbers the engines (Slurm's task id along its nodelist, MPI's
world rank along its hostfile), and dpnb's ranks follow that number.  Engines
on other nodes are not this process's children: the controller relays
signals and shutdowns to their nannies.  A batch launcher places its engines
once: a resize can shrink, and grow back only to the start size.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterable, Sequence

from dpnb.engine import entrypoints as ep
from ...errors import DpnbError
from ..types import RankInfo
from .base import EngineLauncher, ipp_launcher_pids
from .ssh import local_address_towards

log = logging.getLogger(__name__)


class BatchLauncher(EngineLauncher):
    by_launch_rank = True
    ipp_class = ""  # ipyparallel's engine-set launcher's config section

    def configure(self, icluster, profile_dir: str) -> None:
        icluster.config[self.ipp_class].engine_cmd = [self.spec.remote_python or sys.executable,
                                                      "-m", ep.BOOT_MODULE]


def slurm_engine_template(options: Sequence[str]) -> str:
    """ipyparallel's engine job script with ``options`` as ``#SBATCH`` lines
    (braces doubled: ipyparallel formats the script).  ``--output`` is
    written here because ipyparallel adds it only to its own template: without
    it Slurm writes ``slurm-JOBID.out`` into the notebook's folder."""
    lines = "".join(f"#SBATCH {o.replace('{', '{{').replace('}', '}}')}\n" for o in options)
    return ("#!/bin/sh\n#SBATCH --export=ALL\n#SBATCH --job-name=ipengine-{cluster_id}\n"
            "#SBATCH --output={output_file}\n"
            f"{lines}srun {{program_and_args}}\n")


#: ``--launcher-arg KEY=VALUE`` keys the Slurm launcher takes
SLURM_KEYS = ("account", "nodes", "options", "qos", "queue", "timelimit")


def apply_slurm_args(icluster, args: Sequence[str]) -> None:
    """``KEY=VALUE`` for ``SlurmEngineSetLauncher`` traits (``queue`` (the
    partition), ``account``, ``timelimit``, ``qos``), plus ``nodes`` and
    ``options`` (sbatch options, e.g. ``--ntasks-per-node=4``), written into
    the job script here: ipyparallel keeps an ``options`` setting but writes
    nothing of it."""
    extra = []
    for a in args:
        key, sep, value = (x.strip() for x in a.partition("="))
        if not sep or not key:
            raise DpnbError(f"--launcher-arg {a!r}: use KEY=VALUE for slurm (e.g. queue=gpu)")
        if key not in SLURM_KEYS:
            raise DpnbError(f"--launcher-arg {key}=...: slurm takes {', '.join(SLURM_KEYS)}")
        if key == "nodes":
            extra.append(f"--nodes={value}")
        elif key == "options":
            extra += shlex.split(value)
        else:
            setattr(icluster.config.SlurmEngineSetLauncher, key, value)
    if extra:
        icluster.config.SlurmEngineSetLauncher.batch_template = slurm_engine_template(extra)


def slurmctld_address() -> str | None:
    """The address of the Slurm controller (``SlurmctldHost``), which the compute
    nodes reach by definition; None if ``scontrol`` cannot tell."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                             timeout=15).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.info("scontrol show config: %s", e)
        return None
    m = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", out, re.M)
    if not m:
        return None
    try:
        return m.group(2) or socket.gethostbyname(m.group(1))
    except OSError:
        return None


# ipyparallel's default engine job, placed on one node (braces doubled for its
# own formatting, which fills n, cluster_id, the command and the output file:
# ipyparallel adds --output only to its own template, and without it Slurm
# writes slurm-JOBID.out into the notebook's folder)
SLURM_PINNED = """#!/bin/sh
#SBATCH --export=ALL
#SBATCH --job-name=ipengine-{{cluster_id}}
#SBATCH --ntasks={{n}}
#SBATCH --nodelist={host}
#SBATCH --output={{output_file}}
srun {{program_and_args}}
"""


class SlurmLauncher(BatchLauncher):
    name = "slurm"
    ipp_engines = "slurm"
    ipp_class = "SlurmEngineSetLauncher"

    def check(self, n: int) -> None:
        """Settings are read when the cluster is configured (:func:`apply_slurm_args`)."""

    def configure(self, icluster, profile_dir: str) -> None:
        super().configure(icluster, profile_dir)
        cfg = icluster.config.SlurmEngineSetLauncher
        cfg.environment = self.spec.env_dict  # sbatch --export=ALL
        # ipyparallel writes the script into its work_dir, the notebook's
        # folder; an absolute name keeps it in the profile, removed at stop
        cfg.batch_file_name = os.path.join(profile_dir, "slurm_engine.sbatch")
        if self.spec.launcher_args:
            apply_slurm_args(icluster, self.spec.launcher_args)

    def _controller_ip(self) -> str:
        ctl = slurmctld_address()
        return local_address_towards(ctl) if ctl else "*"

    def start_replacements(self, ranks: Sequence[RankInfo], dead: list[int]) -> dict | None:
        """One job per host, pinned there with ``--nodelist``: a replacement
        takes its dead rank's node (and local rank, and GPU)."""
        for host, k in collections.Counter(ranks[r].host for r in dead).items():
            cfg = self.ipp.config.SlurmEngineSetLauncher
            cfg.batch_template = SLURM_PINNED.format(host=host)
            try:
                self.ipp.start_engines_sync(n=k)
            finally:
                del cfg["batch_template"]
        return None


def mpi_first_host(args: Sequence[str]) -> str | None:
    """The first host mpiexec's ``--hostfile F`` / ``--host a,b`` names (None: this host)."""
    args = list(args)
    for i, a in enumerate(args[:-1]):
        host = None
        if a in ("--hostfile", "-hostfile", "--machinefile", "-machinefile"):
            try:
                with open(args[i + 1]) as f:
                    host = next((ln.split()[0] for ln in f
                                 if ln.strip() and not ln.lstrip().startswith("#")), None)
            except OSError as e:
                raise DpnbError(f"mpiexec hostfile {args[i + 1]!r}: {e.strerror}") from None
        elif a in ("--host", "-host", "-H"):
            host = args[i + 1].split(",")[0].split(":")[0]
        if host:
            if host in ("localhost", "127.0.0.1", socket.gethostname()):
                return None
            return socket.gethostbyname(host)
    return None


class MpiLauncher(BatchLauncher):
    name = "mpi"
    ipp_engines = "mpi"
    ipp_class = "MPIEngineSetLauncher"

    def root_pids(self, ranks: Iterable[RankInfo]) -> list[int]:
        # mpiexec runs here, whichever hosts its ranks are on
        return super().root_pids(ranks) + ipp_launcher_pids(self.ipp)

    def check(self, n: int) -> None:
        """``--launcher-arg`` values are mpiexec's own options, passed as they are."""

    def configure(self, icluster, profile_dir: str) -> None:
        super().configure(icluster, profile_dir)
        env = self.spec.env_dict
        # mpiexec refuses to run as root and to place more ranks than cores
        # unless told; dpnb's own processes are what it launches here.
        # Open MPI passes variables to ranks on other hosts only when named (-x).
        forward = [*env, "IPP_CONNECTION_INFO", "IPP_PROFILE_DIR", "IPP_CLUSTER_ID"]
        icluster.config.MPILauncher.mpi_args = [*self.spec.launcher_args,
                                                *(a for k in forward for a in ("-x", k))]
        if os.geteuid() == 0:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        icluster.config.MPIEngineSetLauncher.environment = env

    def _controller_ip(self) -> str:
        first = mpi_first_host(self.spec.launcher_args)
        return local_address_towards(first) if first else "127.0.0.1"

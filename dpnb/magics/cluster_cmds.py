"""%dp subcommands: start, attach, inspect, restart and stop the cluster.

Each handler carries its parser and help (see :mod:`.options`).
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from .. import cluster as cl
from .. import log as dlog
from .. import session
from ..agent import door
from ..cluster import keep
from ..cluster.types import BACKENDS, LAUNCHERS, TORCH_DEFAULT_TIMEOUT_S, StartOptions, Status
from ..display import show_status
from ..session.replica import planned_placement
from dpnb.engine import entrypoints as ep
from .options import subcommand


class ClusterCommands:
    """Mixed into :class:`dpnb.magics.DPMagics` (``self._need()``, ``self.shell``)."""

    @subcommand("start")
    @magic_arguments()
    @argument("-n", type=int, default=2, help="number of engines (ranks), default 2")
    @argument("--backend", default="auto", choices=BACKENDS,
              help="auto: nccl when every engine has its own GPU, else gloo")
    @argument("--engines", default="local", choices=LAUNCHERS,
              help="ipyparallel launcher for the engines (default local)")
    @argument("--gpus", default=None, help="GPU ordinals to use per host, e.g. 0,1,2,3")
    @argument("--timeout", type=float, default=None,
              help="process-group timeout in seconds: how long a collective waits for a "
                   "busy peer before it errors (default: torch's, "
                   f"{TORCH_DEFAULT_TIMEOUT_S['gloo']:g} s for gloo, "
                   f"{TORCH_DEFAULT_TIMEOUT_S['nccl']:g} s for nccl; a raising, dead or "
                   "deadlocked rank is released in under a second whatever it is)")
    @argument("--seed", type=int, default=None,
              help="rank r seeds torch, numpy and random with SEED + r, for a reproducible "
                   "session (default: every rank from fresh entropy, as under torchrun)")
    @argument("--threads", type=int, default=None,
              help="torch threads per engine (default: cores / engines per host)")
    @argument("--launcher-arg", action="append", default=None, dest="launcher_args",
              help="launcher setting (repeatable): HOST=N for ssh (N engines on HOST), an "
                   "mpiexec option for mpi (e.g. --hostfile F), KEY=VALUE for slurm (queue, "
                   "account, timelimit, qos, nodes, options)")
    @argument("--env", action="append", default=None, metavar="KEY=VALUE",
              help="environment variable for every engine on every launcher (repeatable), "
                   "e.g. --env GLOO_SOCKET_IFNAME=eth1 --env NCCL_DEBUG=INFO")
    @argument("--remote-python", default=None, metavar="PATH",
              help="the Python to run on other hosts (ssh), one that has dpnb installed "
                   "(default: python3 on the remote PATH)")
    @argument("--ssh-config", default=None, metavar="FILE", help="ssh config file for --engines ssh")
    @argument("--keep", default=None, metavar="TTL",
              help="leave the cluster running when this kernel exits, for TTL (e.g. 30m, 2h, 1d) "
                   "after the last kernel lets go; %%dp attach in a new kernel takes it up again "
                   "(local engines)")
    @argument("--no-zygote", action="store_true",
              help="local engines: start each as its own Python (each imports torch) instead of "
                   "forking them from one process that imported torch once")
    @argument("--spares", type=int, default=0, metavar="K",
              help="keep K more engines registered on each host than it has ranks, so that "
                   "%%dp restart replaces a dead rank at once instead of starting an engine "
                   "(local engines forked by the zygote, and ssh)")
    @argument("--master-addr", default=None,
              help="address of rank 0 the other ranks reach the process group's store on "
                   "(default: rank 0's address on its route to the controller)")
    @argument("--controller-ip", default=None,
              help="address the controller listens on (default: loopback for local engines, "
                   "this host's address towards the first host for ssh, all interfaces for "
                   "slurm)")
    def start(self, a):
        """Start N engines and join them in one torch.distributed process group."""
        if self.cluster is not None and self.cluster.running:
            c = self.cluster
            raise UsageError(f"a dpnb cluster is already running ({c.world_size} ranks, "
                             f"{c.backend}): %dp stop it first, or %dp restart")
        o = StartOptions(n=a.n, backend=a.backend, engines=a.engines, gpus=a.gpus,
                         timeout=a.timeout, threads=a.threads, seed=a.seed,
                         launcher_args=tuple(a.launcher_args or ()),
                         controller_ip=a.controller_ip, env=a.env,
                         remote_python=a.remote_python, ssh_config=a.ssh_config,
                         master_addr=a.master_addr, zygote=False if a.no_zygote else None,
                         keep=a.keep, spares=a.spares)
        c = session.Cluster.start_with(o, warm=None if a.no_zygote or a.keep else self.warm)
        self.cluster = c
        door.open_door(c)  # dpnb mcp reaches it through this kernel (dpnb.agent.door)
        devs = sorted({r.device for r in c.ranks})
        seeded = "" if c.seed is None else f", seed {c.seed} + rank"
        hosts = sorted({r.host for r in c.ranks})
        print(f"dpnb: {c.world_size} ranks up ({c.backend}, {', '.join(devs)}, "
              f"{len(hosts)} host{'s' if len(hosts) > 1 else ''}, group timeout "
              f"{c.timeout_s:g} s{seeded}). Use %%dp to run cells on them.")
        if len(hosts) > 1:
            print(f"dpnb: {cl.placement.host_layout(c.ranks)}")
        if c.keep_s:
            print(f"dpnb: kept: it outlives this kernel by {keep.fmt_duration(c.keep_s)}; "
                  f"%dp attach in a new kernel takes it up, %dp stop ends it.")

    @subcommand("stop")
    @magic_arguments()
    def stop(self, a):
        """Stop every process dpnb started (controller, engines)."""
        c = self._need()
        pids = c.stop()
        print(f"dpnb: cluster stopped ({len(pids)} processes).")
        if c.spec.zygote:  # a local cluster is usually followed by another
            self.prewarm()

    @subcommand("attach")
    @magic_arguments()
    @argument("id", nargs="?", default=None, help="which kept cluster (see %%dp list); "
              "default: the only one")
    def attach(self, a):
        """Take up a cluster a kernel left running with %%dp start --keep: its engines, their
        state, the setup log and train history."""
        if self.cluster is not None and self.cluster.running:
            raise UsageError("a dpnb cluster is already running in this kernel: %dp stop it "
                             "first (a kept one: end this kernel, and it stays)")
        c = self.cluster = session.Cluster.attach(a.id)
        door.open_door(c)
        print(f"dpnb: attached to kept cluster {c.cluster_id}: {c.world_size} ranks "
              f"({c.backend}), everything on the engines as it was; "
              f"{len(c.setup_log)} setup steps and {len(c.training.train_log)} train calls known.")

    @subcommand("list")
    @magic_arguments()
    def list(self, a):
        """The kept clusters (%%dp start --keep): ranks, age, time to live, which kernel holds them."""
        recs = keep.kept()
        print("\n".join("dpnb: " + keep.describe(r) for r in recs) if recs else
              "dpnb: no kept clusters (start one with %dp start -n 2 --keep 2h)")

    @subcommand("status")
    @magic_arguments()
    def status(self, a):
        """Table of ranks: host, pid, device, backend, alive, memory in use; where the
        peer copies are kept, when they are on."""
        c = self._need()
        show_status(c.status())
        where = planned_placement(c)
        if where:
            print(f"dpnb: {where}")
        if c.spares is not None:
            print(f"dpnb: {c.spares.describe()}")

    @subcommand("restart")
    @magic_arguments()
    @argument("--hard", action="store_true", help="replace every engine (all state is lost)")
    @argument("--resume", default=None, metavar="DIR", nargs="?", const="",
              help="then rebuild the model on every rank (replaying the %%%%dp --setup cells, the "
                   "wrap and the data) and load the checkpoint in DIR (no DIR: the latest one "
                   "%%dp train --checkpoint-every wrote)")
    def restart(self, a):
        """Replace dead engines and re-form the process group; says what was lost."""
        print("dpnb: " + self._need().restart(hard=a.hard, resume=a.resume))

    @subcommand("reform")
    @magic_arguments()
    def reform(self, a):
        """Destroy and re-create the process group on a fresh port (state kept); says what
        was moved to the new group."""
        print("dpnb: " + self._need().reform()["message"])

    @subcommand("interrupt")
    @magic_arguments()
    @argument("--ranks", default=None, help="ranks to interrupt (default all)")
    def interrupt(self, a):
        """Send SIGINT (KeyboardInterrupt) to the engines of the selected ranks."""
        self._need().interrupt(a.ranks)

    @subcommand("where")
    @magic_arguments()
    @argument("--ranks", default=None, help="ranks to ask (default all)")
    def where(self, a):
        """Where each rank is: idle, or running which cell line, inside which collective."""
        print("dpnb: " + self._need().where(a.ranks).replace("\n", "\n  "))

    @subcommand("debug")
    @magic_arguments()
    @argument("--rank", type=int, default=None, help="rank to inspect (default: the first that raised)")
    @argument("-c", "--command", action="append", default=None, dest="commands", metavar="CMD",
              help="a pdb command to run instead of prompting (repeatable; then q)")
    def debug(self, a):
        """pdb post mortem of the last failed cell on a rank, its prompt in the notebook
        (where no prompt is possible: its frames, with their locals)."""
        text = self._need().debug(a.rank, commands=a.commands)
        if text:
            print(text)

    @subcommand("log")
    @magic_arguments()
    @argument("--last", type=int, default=20, help="records to show (default 20)")
    @argument("--ranks", action="store_true", help="also each rank's engine log")
    def log(self, a):
        """dpnb's log: every exception dpnb caught and did not raise (DPNB_LOG=debug: live)."""
        rows = dlog.recent(a.last)
        print("\n".join(rows) if rows else "dpnb log: empty (nothing was caught)")
        if a.ranks:
            c = self._need()
            res = c.call(ep.LOG_RECORDS, a.last, raise_errors=False)
            for r in res.ranks:
                o = res.outcomes[r]
                got = o.value if o.status == Status.OK else [f"(no answer: {o.status})"]
                print(f"[rank {r}]\n" + ("\n".join(got) if got else "(empty)"))

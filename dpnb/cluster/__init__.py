"""The notebook side of a dpnb cluster: engines, ranks, process group, cells.

An :class:`Engines` owns one ipyparallel cluster (a controller and one engine
per rank) and knows which engine is which rank.  Ranks are assigned once from
the engines' hosts and sorted engine ids (contiguous per host, like
torchrun), never from a single engine id, because ids change when engines
are replaced.

It composes the rooms of this package, each with one job:

* :mod:`~dpnb.cluster.launch` -- start engines, probe, assign ranks;
* :mod:`~dpnb.cluster.transport` -- send cells and calls, wait for every rank;
* :mod:`~dpnb.cluster.group` -- form and re-form the torch.distributed group;
* :mod:`~dpnb.cluster.diagnose` -- per-rank outcomes to one error (pure);
* :mod:`~dpnb.cluster.processes` -- local PIDs, deaths, kills, the reaper;
* :mod:`~dpnb.cluster.restart` -- replace engines, resume from a checkpoint;
* :mod:`~dpnb.cluster.turn` -- one driver at a time: the notebook, or an agent;
* :mod:`~dpnb.cluster.keep` -- outliving the kernel (``--keep``), attaching;
* :mod:`~dpnb.cluster.types` / :mod:`~dpnb.cluster.render` -- results and
  how they are shown.

This package is the engines runtime: it knows nothing of training.  The
training session (:mod:`dpnb.session`) builds the public :class:`dpnb.Cluster`
on top of :class:`Engines`; this package never imports it.
"""

from __future__ import annotations

import atexit
import dataclasses
import collections
import logging
import os
import shutil
import time
import weakref
from collections.abc import Sequence

from .. import log as _log
from ..errors import DpnbError, NotRunningError
from ..ranks import parse_ranks, rank_label
from . import diagnose, engines, launch, publish
from . import keep as keeping
from .debugging import post_mortem
from .leftbehind import SETTLE_S as LEFT_BEHIND_SETTLE_S, release_left_behind
from .group import Group
from .launchers import EngineLauncher, launcher_for
from .processes import Processes
from .render import show_result
from .scripts import run_script as _run_script
from .status import status_rows
from .restart import Restarted, end_frozen as _end_frozen, restart as _restart
from .worldref import World, WorldRef
from .transport import Transport, _runner_fn, unpack_value, unsendable
from .turn import Turn, notebook_turn
from .types import (BACKENDS, LAUNCHERS, SETUP_LOG_MAX, CellRecord, CellResult, EntryKind, Health,
                    LaunchSpec, RankInfo, RankOutcome, StartOptions, Status, WaitKind)

__all__ = ["Engines", "CellResult", "RankInfo", "RankOutcome", "BACKENDS", "LAUNCHERS",
           "assign_ranks", "describe_exit"]

from .placement import assign_ranks
from .processes import describe_exit

log = logging.getLogger(__name__)


class Engines(keeping.Kept):
    """A running set of engines, one per rank, in one process group.

    The runtime under :class:`dpnb.Cluster` (which adds the training verbs);
    create one with :func:`dpnb.start` / :meth:`dpnb.Cluster.start`.  Methods
    mirror the ``%dp`` magics: :meth:`run` (``%%dp``), :meth:`call`,
    :meth:`push`, :meth:`pull`, :meth:`status`, :meth:`restart`, :meth:`stop`.
    """

    def __init__(self, *, ipp_cluster, client, ranks: list[RankInfo], backend: str,
                 engine_launcher: EngineLauncher, timeout_s: float, profile_dir: str,
                 master_addr: str, threads: int, gpus: list[int] | None,
                 seed: int | None = None):
        self._ipp = ipp_cluster
        self.engine_launcher = engine_launcher  # how engines start, are signalled, stop
        self.spec = engine_launcher.spec
        self.client = client
        self.worlds = WorldRef(World(ranks=ranks))  # replaced whole on every change
        self.profile_dir = profile_dir
        self.gpus = gpus
        self.local = engine_launcher.engines_here
        self.running = True
        self.health = Health()
        engine_launcher.bind(ipp_cluster, client)  # it owns what it started
        engine_launcher.remember(ranks)
        self.procs = Processes(engine_launcher, profile_dir)
        self.transport = Transport(client, self.worlds, self.health, engine_launcher, timeout_s)
        self.group = Group(self.transport, self.worlds, self.health, backend=backend,
                           master_addr=master_addr, timeout_s=timeout_s, threads=threads,
                           local=self.local, env=self.spec.env_dict,
                           watch_pid=engine_launcher.watched_kernel(), seed=seed)
        # every cell and push: what restart --resume and %dp export read (the steps
        # that built the training state are the session's: dpnb.session.record)
        self.history: collections.deque = collections.deque(maxlen=SETUP_LOG_MAX)
        self.last_failure: CellResult | None = None  # for %dp debug
        self.created = time.time()
        self.keep_s: float | None = None  # --keep: seconds it outlives its last kernel
        self.published: publish.Publication | None = None  # set by go_live, once it is whole
        self.turn = Turn()  # one driver at a time: the notebook's, or an agent's (.turn)
        self.agent_door = None  # the agents' way in, once the front opens it (dpnb.agent.door)

    def go_live(self) -> Engines:
        """Whole now (group formed, or a kept one attached): only now published for
        JupyterLab's sidebar, with its exit hook, so a failed start leaves neither.
        The hook stops the cluster (profile and keys too) or lets a kept one go; a
        weak reference lets an unused Cluster go."""
        self.published = publish.Publication(self)
        self.transport.watch_oom(range(self.world_size))  # an OOM kill is named as one
        ref = weakref.ref(self)
        atexit.register(lambda: (ref() is not None and ref()._at_exit()))
        return self

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, n: int = 2, *, warm=None, **options) -> Engines:
        """Start ``n`` engines and join them in a torch.distributed group.  The
        keywords are one :class:`~dpnb.cluster.types.StartOptions` (what each
        means is said there), an unknown one refused in one line; ``warm``: a
        :class:`zygote.WarmZygote` (the kernel's template) to fork the agent from, if usable."""
        return cls.start_with(StartOptions.of(n, **options), warm=warm)

    @classmethod
    def start_with(cls, o: StartOptions, warm=None) -> Engines:
        """Start the cluster ``o`` describes (checked here, once, before anything starts)."""
        ttl = keeping.checked_ttl(o.keep) if o.keep is not None else None
        env = launch.parse_env(o.env)
        spec = LaunchSpec(engines=o.engines, launcher_args=o.launcher_args,
                          controller_ip=o.controller_ip, env=env,
                          remote_python=o.remote_python, ssh_config=o.ssh_config,
                          master_addr=o.master_addr, kept=ttl is not None, spares=o.spares,
                          zygote=launch.zygote_for(o.engines, kept=ttl is not None, asked=o.zygote),
                          host_zygote=launch.host_zygote_for(o.engines, kept=ttl is not None,
                                                             asked=o.zygote,
                                                             env=dict(env)))
        gpu_list = launch.check_start_args(o.n, o.backend, o.engines, o.timeout, o.threads, o.gpus,
                                           o.seed)
        starter = launcher_for(spec)
        starter.check_start(o.n)  # bad launcher settings fail before anything starts
        _log.install()
        icluster, client, profile_dir, watch = launch.bring_up(o.n, starter, o.start_timeout, warm)
        try:
            c = cls._form(icluster, client, n=o.n, backend=o.backend, starter=starter,
                          gpus=gpu_list, timeout=o.timeout, threads=o.threads,
                          profile_dir=profile_dir, seed=o.seed, watch=watch)
            if ttl is not None:
                c.keep_s = ttl
                keeping.hold(c, ttl)
            return c
        except BaseException:
            launch.tear_down(starter, profile_dir, watch)  # all the launcher's start spawned
            raise

    @classmethod
    def _form(cls, icluster, client, *, n, backend, starter: EngineLauncher, gpus, timeout,
              threads, profile_dir, watch, seed=None) -> Engines:
        ranks, backend, timeout, threads = engines.plan_world(
            client, icluster, n, starter, backend=backend, gpus=gpus, timeout=timeout,
            threads=threads)
        addr = starter.master_addr(ranks)
        self = cls(ipp_cluster=icluster, client=client, ranks=ranks, backend=backend,
                   engine_launcher=starter, timeout_s=timeout, profile_dir=profile_dir,
                   master_addr=addr, threads=threads, gpus=gpus, seed=seed)
        try:
            self.group.init_ranks()
            self.group.form()
            starter.keep_spares(self.ranks)  # --spares: registering while the user's cells run
            # the start's reaper guards this process's children from now on by the cluster's list
            self.procs.adopt_reaper(watch, self.ranks)
        except BaseException:
            self.running = False  # the start tears the processes down; this object is dead
            raise
        return self.go_live()

    # --------------------------------------------------------------- basics
    world = property(lambda self: self.worlds.now)  # ranks, port, generation, doors
    ranks = property(lambda self: self.world.ranks)  # ranks[r]: rank r (a tuple)
    world_size = property(lambda self: self.world.size)

    backend = property(lambda self: self.group.backend)
    launcher = property(lambda self: self.engine_launcher.name)
    agents = property(lambda self: self.engine_launcher.agents)  # host agents, if any
    spares = property(lambda self: self.engine_launcher.spares)  # --spares, if any
    timeout_s = property(lambda self: self.group.timeout_s)
    threads = property(lambda self: self.group.threads)
    seed = property(lambda self: self.group.seed)  # --seed, or None: fresh entropy per rank
    master_addr = property(lambda self: self.group.master_addr)
    master_port = property(lambda self: self.world.master_port)
    dead = property(lambda self: self.health.dead)
    busy = property(lambda self: self.health.busy)
    group_ok = property(lambda self: self.health.group_ok)
    generation = property(lambda self: self.world.generation)
    cluster_id = property(lambda self: self._ipp.cluster_id)  # ipyparallel's, for --keep
    cluster_file = property(lambda self: self._ipp.cluster_file)  # its connection, for --keep

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (f"<dpnb.Cluster {state}: {self.world_size} ranks, {self.backend}, "
                f"{self.launcher} launcher>")

    def require_running(self) -> None:
        if not self.running:
            raise NotRunningError("this cluster was stopped: start a new one with %dp start -n 2")

    def _select(self, ranks) -> list[int]:
        self.require_running()
        sel = parse_ranks(ranks, self.world_size)
        self.transport.refresh_busy()
        if release_left_behind(self.transport, self.health):  # their calls fail now
            self.transport.wait_settled(LEFT_BEHIND_SETTLE_S)
        dead = [r for r in sel if r in self.dead]
        if dead:
            raise DpnbError(f"{rank_label(dead)} died ({self.dead[dead[0]]}): run %dp restart "
                            f"to bring the world back to {self.world_size} ranks")
        busy = [r for r in sel if r in self.busy]
        if busy:
            raise DpnbError(f"{rank_label(busy)} still running an earlier cell: wait, or "
                            f"%dp interrupt, or %dp restart")
        if not self.group_ok and not self.busy and not self.dead:
            # a group left broken while a rank was busy: re-form before going on
            ok, msg = self.group.try_reform()
            log.info("re-formed the group before the next cell: %s", msg)
        return sel

    # ------------------------------------------------------------------ run
    @notebook_turn
    def run(self, code: str, ranks=None, *, timeout: float | None = None, stream: bool = True,
            display: bool = True, raise_errors: bool = True,
            unchecked: bool = False, history: bool = True,
            flags: tuple[str, ...] = ()) -> CellResult:
        """Run ``code`` on the selected ranks (all by default), like ``%%dp``.

        Each rank runs the cell in its own namespace with IPython (so
        ``!cmd``, ``%magic`` and the last expression's value work).  Output
        streams while the cell runs and is then shown grouped by rank, with
        identical output shown once.  ``timeout`` bounds the cell's wall time:
        ranks still running then are interrupted and reported.  ``unchecked=True`` (``%%dp
        --unchecked``): its collectives skip the mismatch check
        (:mod:`dpnb.engine.cell.cellguard`).  ``history=False``: not recorded (a replay).
        ``flags``: carried to the ranks' hooks with the cell (:mod:`dpnb.core.cellflags`).
        """
        sel = self._select(ranks)
        if not isinstance(code, str):
            raise DpnbError("code must be a string of Python source")
        ars = self.transport.execute(code, sel, unchecked=unchecked, flags=tuple(flags))
        res = self.transport.wait(ars, sel, timeout=timeout, stream=stream and display,
                                  kind=WaitKind.EXECUTE)
        if display:
            show_result(res)
        if history:
            self.remember(CellRecord(EntryKind.CELL, code, None if len(sel) == self.world_size
                                     else tuple(sel), res.ok))
        return self._finish(res, raise_errors)

    def remember(self, rec: CellRecord) -> CellRecord:
        """Append ``rec`` to the history, numbered after everything sent before it."""
        seq = self.history[-1].seq + 1 if self.history else 0
        rec = dataclasses.replace(rec, seq=seq)
        self.history.append(rec)
        return rec

    def run_script(self, path: str, args=(), **kw) -> CellResult:
        """Run a torchrun script on every rank, as torchrun would (``%dp run``);
        see :func:`dpnb.cluster.scripts.run_script`."""
        return _run_script(self, path, args, **kw)

    @notebook_turn
    def call(self, dotted: str, *args, ranks=None, timeout: float | None = None,
             raise_errors: bool = True, display: bool = False, on_poll=None,
             **kwargs) -> CellResult:
        """Call the engine-side function ``dotted(ns, *args, **kwargs)`` on ranks.

        Only the dotted name travels; the function must live in ``dpnb``.
        Errors are handled like :meth:`run` (report, group re-formation).
        """
        sel = self._select(ranks)
        ars = self.transport.call_async(dotted, args, kwargs, sel)
        res = self.transport.wait(ars, sel, timeout=timeout, stream=display, kind=WaitKind.APPLY,
                                  on_poll=on_poll)
        if display:
            show_result(res)
        return self._finish(res, raise_errors)

    def _finish(self, res: CellResult, raise_errors: bool) -> CellResult:
        if res.ok:
            if res.released:  # everyone finished after all, but the groups are gone
                self.group.try_reform()
            return res
        err = diagnose.plain_user_error(res)
        if err is not None and res.released:
            self.group.try_reform()
        err = err or self._report(res)
        self.last_failure = res
        if raise_errors:
            raise err
        res.error = err
        return res

    def _report(self, res: CellResult):
        """The failed cell's report; re-form the group first if it needs it."""
        d = diagnose.classify(res)
        reformed, msg = False, ""
        if d.died:
            self.health.group_broken(f"it cannot continue without {rank_label(d.died)}")
            alive = (r for r in range(self.world_size) if r not in d.died)
            msg = (f"The process group cannot continue without {rank_label(d.died)}: run "
                   f"%dp restart to replace {'it' if len(d.died) == 1 else 'them'} and re-form the group "
                   f"({diagnose.kept(alive)}).")
        elif d.needs_reform and not self.busy:
            bad = {r: str(getattr(o.status, "value", o.status))
                   for r, o in sorted(res.outcomes.items()) if not o.ok}
            self.health.group_broken("a call failed (" + ", ".join(
                f"rank {r}: {st}" for r, st in bad.items()) + "); re-formed at once")
            reformed, msg = self.group.try_reform()
        elif d.needs_reform:
            self.health.group_broken(f"a failed collective, {rank_label(self.busy)} still busy")
            msg = (f"{rank_label(self.busy)} still busy, so the process group was not "
                   f"re-formed yet: wait and run %dp reform, or %dp restart.")
        return diagnose.remote_error(res, d, timeout_s=self.timeout_s, reform_msg=msg,
                                     reformed=reformed)

    # ------------------------------------------------------------ group
    @property
    def incidents(self) -> tuple:
        """Every change in the cluster's health the notebook saw, in order
        (:class:`dpnb.core.incidents.Incident`: deaths, calls it stopped waiting
        for, a broken group, healthy again, ranks replaced); ``%dp incidents``."""
        return tuple(self.health.incidents)

    @notebook_turn
    def reform(self) -> dict:
        """Destroy and re-create the process group on a fresh port.

        Every rank takes part.  User objects stay; what they hold on the old
        group is moved to the new one.  The returned dict's ``message`` says
        what was moved (``rebound``) and what could not be (``left``).
        """
        self.require_running()
        if self.dead:
            raise DpnbError(f"{rank_label(self.dead)} died: run %dp restart instead")
        return self.group.reform_said(hint="; try %dp restart")

    def adopt_ranks(self, ranks: list[RankInfo], *, fresh: Sequence[int] = (),
                    new_world: bool = False) -> None:
        """Take a new rank table (:mod:`.engines`): ``fresh`` ranks lose their old doors
        and death marks, the reaper follows the PIDs; ``new_world`` (a resize): all
        alive and idle, local torch threads follow the engines per core."""
        self.health.replaced(fresh)
        if new_world:
            self.health.new_world()
            if self.local:
                per_host = max(ri.local_world_size for ri in ranks)
                self.group.threads = max(1, (os.cpu_count() or 1) // per_host)
        self.worlds.set(self.world.with_ranks(ranks, fresh=fresh))
        self.engine_launcher.remember(self.ranks)
        self.procs.write_reaper_file(self.ranks)
        self.transport.watch_oom(range(len(ranks)) if new_world else fresh)

    def reform_all(self, new: Sequence[int] = ()) -> dict:
        """Re-form the group when some ranks are fresh engines needing ``init_rank``."""
        return self.group.reform_all(new)

    def where(self, ranks=None) -> str:
        """Where every (or the selected) rank is now, through the side doors.

        Works while ranks are busy (a cell the notebook stopped waiting for):
        finished / running, the cell line, the collective it is inside.
        """
        self.require_running()
        sel = parse_ranks(ranks, self.world_size)
        self.transport.refresh_busy()
        answers = self.transport.where(sel)
        # a rank in a cell the notebook still waits for runs too (an agent's where, meanwhile)
        running = set(self.busy) | {r for r, a in answers.items() if a and a.get("busy")}
        return diagnose.where_report(sel, answers, busy=running, dead=self.dead)

    @notebook_turn
    def debug(self, rank: int | None = None, commands=None) -> str:
        """pdb post mortem of the last failed cell on a rank; see
        :func:`dpnb.cluster.debugging.post_mortem`."""
        return post_mortem(self, rank, commands)

    def interrupt(self, ranks=None) -> None:
        """Interrupt what the selected ranks are running (all by default)."""
        self.require_running()
        self.transport.interrupt(parse_ranks(ranks, self.world_size))

    @notebook_turn
    def push(self, values: dict, ranks=None) -> None:
        """Copy ``values`` (name -> object) into the namespaces of the ranks."""
        sel = self._select(ranks)
        if not isinstance(values, dict) or not all(isinstance(k, str) and k.isidentifier()
                                                   for k in values):
            raise DpnbError("push takes a dict of name -> value with valid Python names")
        ars = self.transport.broadcast(_runner_fn("set_values"), (values,), sel)
        self._finish(self._wait_values(ars, sel), True)
        self.remember(CellRecord(EntryKind.PUSH, names=tuple(values)))

    @notebook_turn
    def pull(self, name: str, rank: int | None = None):
        """``name`` on ``rank``, or one value per rank (one round trip); tensors on the CPU."""
        if not isinstance(name, str) or not name.isidentifier():
            raise DpnbError(f"pull needs a variable name, got {name!r}")
        sel = self._select(None if rank is None else [rank])
        res = self._wait_values(self.transport.apply(_runner_fn("get_value"), (name,), sel), sel)
        oc = res.outcomes
        failed = [o for o in oc.values() if o.status == Status.ERROR and "serialize" in o.traceback]
        if len(failed) < sum(o.status != Status.OK for o in oc.values()):
            self._finish(res, True)  # a rank failed otherwise (died, ...): its report
        lacking = [r for r in sel if oc[r].status == Status.OK and oc[r].value is None]
        if lacking:
            have = [r for r in sel if r not in lacking]
            hint = f"; pull it from {rank_label(have)} with --rank {have[0]}" if have else ""
            raise DpnbError(f"{name!r} is not defined on {rank_label(lacking)}{hint}")
        if failed:
            raise unsendable(name, f"{failed[0].ename}: {failed[0].evalue}")
        vals = [unpack_value(name, bufs) for bufs in self._finish(res, True).values]
        return vals[0] if rank is not None else vals

    def _wait_values(self, ars: dict, sel: list[int]) -> CellResult:
        return self.transport.wait(ars, sel, timeout=None, stream=False, kind=WaitKind.VALUE)

    @notebook_turn
    def status(self) -> list[dict]:
        """One row per rank: host, local rank, pid, device, backend, alive, memory."""
        self.require_running()
        return status_rows(self)

    # ----------------------------------------------------------- restart
    def restart(self, *, hard: bool = False) -> str:
        """Replace dead engines and re-form the group; say what was lost.

        Survivors keep their namespaces; a replacement takes the dead rank's
        number and starts empty.  ``hard=True`` replaces every engine.
        """
        return self.replace_and_reform(hard=hard).message

    @notebook_turn
    def replace_and_reform(self, *, hard: bool = False) -> Restarted:
        """:meth:`restart`, answering which ranks were replaced (for a resume on top)."""
        self.require_running()
        out = _restart(self.transport, self.group, self.engine_launcher, self.worlds, self.health,
                       self.adopt_ranks, hard=hard)
        self.refresh_keep_record()
        return out

    def wait_settled(self, timeout_s: float) -> list[int]:
        """Wait up to ``timeout_s`` for live ranks still running an old cell to finish
        it (nothing is interrupted); the ranks still busy then."""
        return self.transport.wait_settled(timeout_s)

    def end_frozen(self) -> dict[int, str]:
        """Kill the ranks whose engine is frozen, for a restart to replace them
        (:func:`.restart.end_frozen`); ``{rank: how it was frozen}``."""
        self.require_running()
        return _end_frozen(self.transport, self.health, self.kill_rank)

    def kill_rank(self, r: int) -> None:
        """Stop rank ``r``'s engine for good, the launcher's way (by PID on this
        host, through its host's agent, or through the controller)."""
        self.engine_launcher.kill(self.ranks[r])

    # ------------------------------------------------------------------ stop
    def stop(self) -> list[int]:
        """Stop every process this cluster started; return the local PIDs stopped."""
        if not self.running:
            return []
        self.running = False
        owned = self.procs.owned(self.ranks)
        self.engine_launcher.stop(owned)  # what it started: engines, agents, controller
        self.procs.stop_reaper()
        shutil.rmtree(self.profile_dir, ignore_errors=True)
        if self.published is not None:
            self.published.remove()
        self.close_agent_door()
        if self.keep_s:
            keeping.forget(self)
        return sorted(owned)

    def close_agent_door(self) -> None:
        """No agent reaches this process's cluster any more (stopped, or let go)."""
        door, self.agent_door = self.agent_door, None
        if door is not None:
            door.close()

    def _owned_pids(self) -> list[int]:
        """PIDs of this host's processes of the cluster (controller, engines, nannies)."""
        return sorted(self.procs.owned(self.ranks))

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

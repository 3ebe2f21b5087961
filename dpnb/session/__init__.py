"""The training session: :class:`Cluster` = the engines runtime + the training verbs.

:class:`dpnb.cluster.Engines` runs cells and calls on the ranks and keeps
them alive; it knows nothing of models.  This layer adds what a training job
needs on top, as plain methods: ``wrap``, ``set_data``, ``train``, ``check``,
``save`` / ``load`` / ``pull_model``, ``resize``, ``export`` and ``restart
--resume``, each delegating to the module that does it (:mod:`dpnb.session.verbs`,
:mod:`dpnb.session.resize`, :mod:`dpnb.session.export`, :mod:`.resume`).  What they share --
the last wrap, the last train call, the batch plan, the train calls since the
wrap, the automatic checkpoints' folder, the measured residency -- is one
typed :class:`~.state.TrainingState` on ``cluster.training``; what built the
ranks' state -- setup cells, the wrap, the data -- is the typed steps of
:class:`~.record.SetupRecord` on ``cluster.setup_log``.  Both are kept with the
runtime's record when the cluster outlives its kernel.
"""

from __future__ import annotations

import logging
from typing import Any

from ..cluster import Engines
from ..cluster.diagnose import first_error
from ..cluster.turn import notebook_turn
from ..core.agentgrant import AgentGrant
from ..core.cellflags import profile_flag
from ..core.profile import Profiled
from ..core.profilesummary import summarize
from ..core.trainargs import TrainArgs
from ..core.incidents import KEPT_STEPS_MAX, RunLog, merge_steps, thin_steps
from ..core.viewsource import LastRun
from ..errors import DpnbError
from dpnb.engine import entrypoints as ep
from ..progress import progress_from_client
from . import export as _export
from . import grading as _grading
from . import profile as _profile
from . import resize as _resize
from . import resume as _resume
from . import verbs as _train
from .feed import ProgressFeed
from .record import SetupCell, SetupRecord
from .results import ExportResult, ResizeResult, TrainResult
from .training_state import TrainingState

_log = logging.getLogger(__name__)

__all__ = ["Cluster", "start", "TrainingState"]


def start(n: int = 2, **kwargs) -> Cluster:
    """Start ``n`` engines joined in one process group; see :meth:`Cluster.start`."""
    return Cluster.start(n, **kwargs)


class Cluster(Engines):
    """A running set of engines, one per rank, in one process group, and the
    training job on them.

    Create with :func:`dpnb.start` / :meth:`Cluster.start`.  Methods mirror
    the ``%dp`` magics: :meth:`run` (``%%dp``), :meth:`call`, :meth:`push`,
    :meth:`pull`, :meth:`status`, :meth:`restart`, :meth:`stop`, and the
    training verbs below.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.training = TrainingState()
        self.setup_log = SetupRecord()  # typed steps resume replays, export writes
        # train's progress events, decoded once (dpnb.core.events), to every subscriber;
        # JupyterLab's sidebar (the runtime's publication) hears them all
        self.progress_feed = ProgressFeed()
        self.subscribe(lambda ev: self.published.progress(ev.as_dict()))
        self._last_profile: Profiled | None = None  # none yet: nothing to publish
        #: engines (by PID) whose profiling hook is registered (dpnb.session.profile)
        self.profile_armed: set[int] = set()
        # (exercise, function name) -> failed tries so far (hints grow with them)
        self.grade_tries: dict[tuple[str, str], int] = {}
        # what an agent (dpnb mcp) may do here besides reading: the notebook's yes
        self.agent_grant = AgentGrant()
        #: step rows read from the ranks before a restart or resize replaced some
        #: (a replaced rank's records end with it): %dp incidents draws them too
        self.kept_steps: tuple[tuple, ...] = ()

    def allow_agent(self, actions: bool = False, code: bool = False) -> AgentGrant:
        """Let an agent (``dpnb mcp`` started with the same flags) change this cluster
        (``actions``: interrupt, restart, reform, save) or run code on its ranks
        (``code``); ``allow_agent()`` takes both back.  Reads are always served to
        this user's agents (``%dp agent``)."""
        self.agent_grant = AgentGrant(actions=bool(actions), code=bool(code))
        return self.agent_grant

    @property
    def last_profile(self) -> Profiled | None:
        """The last profiled cell's analysis and traces (``%%dp --profile``; None before one)."""
        return self._last_profile

    @last_profile.setter
    def last_profile(self, prof: Profiled | None) -> None:
        # JupyterLab's panel shows it beside the notebook: the runtime publishes the plain
        # summary it is handed (the cell's view's sentences; no trace contents)
        self._last_profile = prof
        self.published.profile(None if prof is None else summarize(prof))

    @notebook_turn
    def run(self, code: str, ranks=None, *, setup: bool = False, **kw):
        """Run a cell (``%%dp``); see :meth:`dpnb.cluster.Engines.run`.  ``setup=True``
        (``%%dp --setup``): once it succeeded on every rank, the cell is a step of
        the setup record that ``restart --resume`` replays and ``%dp export`` writes."""
        if setup and ranks is not None and len(self._select(ranks)) != self.world_size:
            raise DpnbError("a --setup cell must run on every rank (resume replays it on all)")
        res = super().run(code, ranks, **kw)
        if res.ok and setup and kw.get("history", True):
            # the one record of a setup cell: the session's, naming the runtime's entry
            self.setup_log.add(SetupCell(code, self.history[-1].seq))
        return res

    def profile(self, code: str, ranks=None, *, out_dir: str | None = None, wait: bool = False,
                **run_kw):
        """Run a cell with ``torch.profiler`` on every selected rank (``%%dp --profile``);
        the analysis is kept in :attr:`last_profile`, its trace files written just
        after (``wait=True``: before this returns).  Each rank starts its profiler
        as the cell arrives (no request before it).  See :mod:`dpnb.session.profile`."""
        return self.profiled(
            lambda tag: self.run(code, ranks=ranks, flags=(profile_flag(tag),), **run_kw),
            ranks=ranks, out_dir=out_dir, wait=wait, in_request=True)

    @notebook_turn
    def profiled(self, run, *, ranks=None, what: str = "cell", out_dir: str | None = None,
                 wait: bool = False, in_request: bool = False):
        """``run()`` (a cell, a train, a script) with every selected rank profiled; its
        result.  ``in_request``: ``run(tag)`` sends a cell flagged ``profile_flag(tag)``."""
        return _profile.profiled(self, run, ranks=ranks, what=what, out_dir=out_dir,
                                 wait=wait, in_request=in_request)[0]

    @notebook_turn
    def grade(self, exercise: str, name: str | None = None, *, reveal: bool = False, **kw):
        """Grade the function ``name`` the learner defined on every rank against
        ``exercise`` (``%dp grade``); a :class:`dpnb.core.grading.Grade`.  See
        :mod:`dpnb.session.grading`."""
        return _grading.grade(self, exercise, name, reveal=reveal, **kw)

    @notebook_turn
    def wrap(self, model: str = "model", strategy: str = "ddp", **opts) -> dict:
        """Wrap a model that exists on every rank; see :func:`dpnb.session.verbs.wrap`."""
        return _train.wrap(self, model, strategy, **opts)

    @notebook_turn
    def set_data(self, dataset: str, **opts) -> dict:
        """Train on the dataset named ``dataset`` on every rank; see :func:`dpnb.session.verbs.set_data`."""
        return _train.set_data(self, dataset, **opts)

    @notebook_turn
    def train(self, args: TrainArgs | None = None, /, **opts) -> TrainResult | None:
        """Run training steps with live progress: ``c.train(steps=20, micro_batch=8)``, or
        one :class:`~dpnb.core.trainargs.TrainArgs` (not both); see
        :func:`dpnb.session.verbs.train`."""
        if args is not None and opts:
            raise DpnbError("give train either a TrainArgs or keywords, not both")
        return _train.train(self, args if args is not None else TrainArgs.of(**opts))

    @notebook_turn
    def check(self, model: str | None = None) -> dict:
        """Are the replicas in sync?  See :func:`dpnb.session.verbs.check`."""
        return _train.check(self, model)

    @notebook_turn
    def save(self, path: str) -> dict:
        return _train.save(self, path)

    @notebook_turn
    def load(self, path: str) -> dict:
        return _train.load(self, path)

    @notebook_turn
    def pull_model(self) -> dict:
        return _train.pull_model(self)

    @notebook_turn
    def resize(self, n: int, **opts) -> ResizeResult:
        """Go on training on ``n`` ranks; see :func:`dpnb.session.resize.resize`."""
        self.keep_steps()
        return _resize.resize(self, n, **opts)

    @notebook_turn
    def export(self, out_dir: str, **opts) -> ExportResult:
        """Write this session as a batch job; see :func:`dpnb.session.export.export`."""
        return _export.export(self, out_dir, **opts)

    @notebook_turn
    def restart(self, *, hard: bool = False, resume: str | bool | None = None) -> str:
        """Replace dead engines and re-form the group; say what was lost.

        ``resume=DIR`` (``""`` or ``True``: the latest automatic checkpoint):
        then rebuild what the checkpoint needs from the cells that built it,
        wrap, and load DIR (model, optimizer, step); see :mod:`.resume`.
        """
        self.keep_steps()
        if resume is None or resume is False:
            return super().restart(hard=hard)
        return _resume.restart_and_resume(self, hard=hard, resume=resume)

    # ------------------------------------------------------------------
    # What the views read (dpnb.core.viewsource.ViewSource): the session hands
    # them typed data; they never reach the ipyparallel client or its state.
    def subscribe(self, fn) -> Any:
        """Call ``fn(event)`` with each :class:`~dpnb.core.events.ProgressEvent` a
        running ``train`` publishes; returns ``unsubscribe``.  See :mod:`.feed`."""
        return self.progress_feed.subscribe(fn)

    def in_flight(self) -> bool:
        """A cell or call is in flight: ipyparallel still waits on some reply."""
        return bool(getattr(self.client, "outstanding", ()))

    def published_progress(self, seen: dict) -> dict[int, dict]:
        """Each rank's latest progress event as a plain dict (datapub, read from the
        client's metadata while the call runs; ``seen`` keeps finished ids)."""
        return progress_from_client(self.client, seen)

    def last_run(self) -> LastRun | None:
        """The last ``%dp train``: its arguments and each rank's final progress."""
        t = self.training.last_train
        return LastRun(t.args.to_record(), t.progress) if t else None

    def run_log(self) -> RunLog:
        """``%dp incidents``' view reads this: the health changes since the start, the
        ranks alive and idle now (asked for their steps; the others are not), and the
        steps kept before ranks were replaced."""
        return RunLog(self.incidents, self.created,
                      tuple(r for r in range(self.world_size)
                            if r not in self.dead and r not in self.busy), self.kept_steps)

    def step_series(self, ranks) -> dict[int, list]:
        """Each of ``ranks``' thinned step series (``[step, t_end, loss, samples/s]``
        rows, :func:`dpnb.engine.metrics.views.step_series`), the ranks with records only.

        One call per rank, no collective: a broken group or a busy peer does
        not stop it, and one rank that fails fails alone (logged, left out).
        A rank killed but not yet known dead, or frozen, is not asked: a call
        reaching it would be a fault in the middle of a call, releasing its
        peers.  ``%dp incidents`` and :meth:`keep_steps` read through here."""
        ranks = list(ranks)
        if not ranks:
            return {}
        gone = {**self.transport.find_dead(ranks), **self.transport.frozen(ranks)}
        got: dict[int, list] = {}
        for r in (r for r in ranks if r not in gone):
            try:
                res = self.call(ep.STEP_SERIES, ranks=[r], raise_errors=False)
            except Exception as e:  # its engine is gone from the controller
                _log.info("rank %s's steps not read: %s: %s", r, type(e).__name__, e)
                continue
            if not res.ok:
                _log.info("rank %s's steps not read: %s", r, first_error(res))
            elif res.values[0]:
                got[r] = res.values[0]
        return got

    def keep_steps(self) -> None:
        """Before ranks are replaced or stopped: read the idle survivors' step series
        into :attr:`kept_steps` (thinned) -- in a storm every rank is replaced in
        turn, and with it its records.  A failure here is logged and never stops
        the restart."""
        ranks = self.run_log().idle_ranks
        if not ranks or self.training.last_wrap is None:
            return
        got = self.step_series(ranks).values()
        self.kept_steps = thin_steps(merge_steps([self.kept_steps, *got]), KEPT_STEPS_MAX)

    def keep_residency(self, model_bytes: int, strategy: str, found: Any) -> dict[str, Any]:
        """The residency view's measurements, kept for this session (not in a kept
        cluster's record): one model size at a time, the latest per strategy."""
        st = self.training
        if st.residency_bytes != model_bytes:
            st.residency = {}
        st.residency_bytes = model_bytes
        st.residency[strategy] = found
        return dict(st.residency)

    def session_record(self) -> dict:
        return {"setup_log": self.setup_log.to_record(), **self.training.to_record()}

    def restore_session(self, rec: dict) -> None:
        self.training = TrainingState.from_record(rec)
        self.setup_log = SetupRecord.from_record(rec.get("setup_log"))

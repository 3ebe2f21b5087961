"""What a view may ask of the session: one typed contract, no reaching into the cluster.

The views (:mod:`dpnb.widgets`) render what the engines measured.  They get it
from a :class:`ViewSource` -- in a notebook the session's ``dpnb.Cluster``,
in a test a plain object -- through the methods below only: engine calls by
name (the ranks answer over ipyparallel, :mod:`dpnb.engine.entrypoints`),
the runtime's per-rank status rows, whether a call is in flight, the
progress the ranks published while it runs (ipyparallel's datapub, decoded
once into typed events, :mod:`dpnb.core.events`: read, or subscribed to), the last ``%dp train`` as a typed :class:`LastRun`, and a
store for the residency measurements the session keeps.  A view never reads
the ipyparallel client, the session's state object or the runtime's parts;
``tests/unit/test_view_contract.py`` holds that.

Pure typing (no torch, no IPython): the session implements it, the views
annotate with it, both import it from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .incidents import RunLog
from .profile import Profiled


@dataclass(frozen=True)
class LastRun:
    """The session's last ``%dp train``, as a view reads it.

    ``settings``: its arguments as a record (``micro_batch``, ``grad_accum``,
    ``lr``, ``seq_len`` ...); ``progress``: rank -> the last progress payload
    each rank published (the run's end, even when no poll fell inside it).
    """

    settings: dict[str, Any]
    progress: dict[int, dict] | None = None


@runtime_checkable
class ViewSource(Protocol):
    """The session side of every view (see the module docstring)."""

    @property
    def world_size(self) -> int: ...

    @property
    def backend(self) -> str: ...

    #: one row per rank, in rank order; a view reads ``.host`` and ``.node_rank``
    ranks: Sequence[Any]
    running: bool
    #: the analysis of the last ``%%dp --profile`` (the profile view's data)
    last_profile: Profiled | None

    def call(self, dotted: str, *args: Any, ranks: Any = None, raise_errors: bool = True,
             **kwargs: Any) -> Any:
        """An engine function on the selected ranks (a collective when it is one)."""

    def status(self) -> list[dict]:
        """One row per rank: host, pid, device, alive, memory."""

    def in_flight(self) -> bool:
        """A cell or call is in flight (a view must not send one now)."""

    def subscribe(self, fn: Any) -> Any:
        """Call ``fn(event)`` with each progress event (:class:`dpnb.core.events.ProgressEvent`)
        a running ``train`` publishes; returns ``unsubscribe``."""

    def published_progress(self, seen: dict) -> dict[int, dict]:
        """Each rank's latest progress payload of the calls in flight and those in
        ``seen`` (message ids, updated in place: a short run's end stays readable)."""

    def last_run(self) -> LastRun | None:
        """The last ``%dp train`` of this session, if any."""

    def run_log(self) -> RunLog:
        """What happened to the cluster (its incidents, since it started) and the ranks
        alive and idle now (:class:`dpnb.core.incidents.RunLog`)."""

    def step_series(self, ranks: Sequence[int]) -> dict[int, list]:
        """Each of ``ranks``' thinned step series, one call per rank (the ranks with
        records; one that is gone, frozen or failing is left out alone)."""

    def keep_residency(self, model_bytes: int, strategy: str, found: Any) -> dict[str, Any]:
        """Keep ``found`` as ``strategy``'s latest residency measurement (one
        model size at a time: another size forgets the rest); every kept one."""

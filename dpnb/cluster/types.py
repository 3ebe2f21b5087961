"""What a cluster knows about its ranks and what one cell did on them.

A leaf module: plain dataclasses and constants, imported by every part of
the notebook side (launch, transport, diagnosis, rendering) and by nothing
heavier.  ``RankOutcome`` / ``CellResult`` are what the transport collects
from the engines and what the diagnosis and the output renderer read.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from ..core.incidents import FAULTS, Incident
from ..errors import DpnbError
from ..core.timeouts import (FORM_TIMEOUT_S, TORCH_DEFAULT_TIMEOUT_S,  # noqa: F401
                             default_timeout, form_timeout)

BACKENDS = ("auto", "gloo", "nccl")
LAUNCHERS = ("local", "mpi", "slurm", "ssh")
#: exception types that mean "bad input, say so in one line": the names of
#: every subclass of dpnb.core.errors.UserError (a test holds the two equal;
#: the engines' classes are not imported here, they bring torch)
USER_ENAMES = frozenset({"UserError", "ConfigError", "DpnbError", "NotRunningError", "RankSpecError",
                         "StartError", "RemoteCellError", "TrainError", "ViewError", "AdoptError",
                         "ActionError", "StartRequestError", "TurnTaken", "AgentRefused",
                         "DoorError", "CheckpointWriteError"})
#: how many cells and pushes the history keeps (what ``restart --resume`` may replay)
SETUP_LOG_MAX = 200
#: how many health changes ``%dp incidents`` keeps
MAX_INCIDENTS = 1000


@dataclass(frozen=True)
class RankInfo:
    """Where one rank lives."""

    rank: int
    engine_id: int
    host: str
    ip: str
    pid: int
    local_rank: int
    local_world_size: int
    node_rank: int
    device: str
    location: str = ""  # the ssh destination its host agent was reached by ("" elsewhere)
    ifname: str = ""    # the interface holding ``ip`` on its host
    # CUDA_VISIBLE_DEVICES its engine is given (--gpus, as torchrun users set
    # it: ``device`` then counts within it); "" leaves the engine's own
    visible_devices: str = ""
    device_fallback: int | None = None  # the ordinal in the engine's own numbering
    # the launcher bound this engine its own GPU (Slurm --gpus-per-task): its
    # code sees LOCAL_RANK 0 of 1, as under `srun torchrun --nproc-per-node=1`
    own_gpu: bool = False


@dataclass(frozen=True, kw_only=True)
class StartOptions:
    """One ``%dp start`` / ``dpnb.start(...)`` call's options, as one value.

    Built by the magic's parser, by ``dpnb.start(n, **kw)`` (:meth:`of`: an
    unknown keyword refused in one line) and by JupyterLab's Start form alike,
    and read by :meth:`dpnb.cluster.Engines.start_with`, which checks it once
    (:func:`dpnb.cluster.launch.check_start_args`) before anything starts.

    ``backend``: ``auto`` picks NCCL when every engine has a GPU of its
    own, else gloo.  ``engines``: ``local``, ``ssh`` (``launcher_args``
    ``["node1=4", "node2=4"]``, one host agent per host, see
    :mod:`dpnb.cluster.agents`), ``mpi`` (mpiexec options in
    ``launcher_args``) or ``slurm`` (sbatch settings).  ``gpus``: device
    ordinals per host.  ``timeout``: seconds a collective may wait for a
    busy peer (default: torch's; :mod:`dpnb.core.timeouts`).  ``env``:
    ``{"GLOO_SOCKET_IFNAME": "eth1"}`` or ``["K=V", ...]`` for every
    engine; ``remote_python``: the Python on other hosts (default
    ``python3``); ``ssh_config``: an ssh config file;
    ``master_addr``: the group's store address instead of rank 0's route
    to the controller.  ``zygote``: local engines forked from one process
    that imported torch once (:mod:`dpnb.engine.hostagent`); default: on
    hosts without an NVIDIA driver (see :func:`dpnb.cluster.launch.zygote_default`);
    ``keep``: a time to live (``"2h"``): the cluster outlives this kernel
    by that long, for :meth:`dpnb.cluster.Engines.attach` (local engines; see :mod:`dpnb.cluster.keep`).
    ``seed``: rank r seeds its generators with ``seed + r`` (default: fresh
    entropy, as torchrun's processes; :mod:`dpnb.engine.proc.seeding`).
    ``spares``: engines each host keeps registered beside its ranks, so that a
    restart replaces a dead rank without waiting for a new engine
    (:mod:`dpnb.cluster.spares`; local engines forked by the zygote, and ssh).
    """

    n: int = 2
    backend: str = "auto"
    engines: str = "local"
    gpus: Any = None  # "0,1" or a list of device ordinals
    timeout: float | None = None
    threads: int | None = None
    start_timeout: float = 120.0
    launcher_args: tuple[str, ...] = ()
    controller_ip: str | None = None
    env: Any = None  # {"K": "V"} or ["K=V", ...]
    remote_python: str | None = None
    ssh_config: str | None = None
    master_addr: str | None = None
    zygote: bool | None = None
    keep: Any = None  # a time to live ("2h", seconds)
    seed: int | None = None
    spares: int = 0  # engines kept ready on each host to replace a dead rank at once

    @classmethod
    def of(cls, n: int = 2, **kw) -> StartOptions:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise DpnbError(f"start takes no {', '.join(unknown)}: its options are "
                            f"{', '.join(sorted(names - {'n'}))} (and warm)")
        if kw.get("launcher_args") is not None:
            kw["launcher_args"] = tuple(kw["launcher_args"])
        else:
            kw.pop("launcher_args", None)
        return cls(n=n, **kw)


@dataclass(frozen=True)
class LaunchSpec:
    """How ``%dp start`` brings engines up, beyond their number.

    ``env``: variables every engine gets on every launcher (set in the engine
    before its group forms, and in the process environment where the
    launcher passes one).  ``remote_python``: the Python the ssh agents (and
    engines) run on the other hosts.  ``master_addr``: the process group's
    store address, overriding rank 0's route to the controller.
    """

    engines: str = "local"
    launcher_args: tuple[str, ...] = ()
    controller_ip: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    remote_python: str | None = None  # ssh: python3; slurm/mpi: this Python's path
    ssh_config: str | None = None
    master_addr: str | None = None
    # local: fork the engines from one process that imported torch once
    # (dpnb.engine.hostagent --zygote) instead of starting N interpreters
    zygote: bool = False
    # ssh: each host's agent forks that host's engines from itself ("on"), decides
    # by its own host's NVIDIA driver ("auto"), or starts one Python each ("off")
    host_zygote: str = "off"
    # --keep: the cluster outlives this kernel (dpnb.cluster.keep); its engines
    # do not watch the kernel and ipyparallel does not stop them at exit
    kept: bool = False
    # --spares: engines each host's agent keeps registered beside the ranks, so a
    # restart gives a dead rank one at once (dpnb.cluster.spares)
    spares: int = 0

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


class Word(str, Enum):
    """An enum whose members are equal to, hash as and print as their plain word
    (as Python 3.11's StrEnum; dpnb runs on 3.10): records stay JSON as before."""

    def __str__(self) -> str:
        return self.value


class Status(Word):
    """How one rank's part of a cell or call ended (equal to its plain name)."""

    PENDING = "pending"
    OK = "ok"
    ERROR = "error"
    DIED = "died"
    TIMEOUT = "timeout"
    INTERRUPTED = "interrupted"  # Ctrl-C
    STOPPED = "stopped"  # interrupted because a peer failed
    LATE = "late"  # still in Python code when a peer's collective failed: a culprit
    DEADLOCKED = "deadlocked"  # released from a collective no rank could join
    FROZEN = "frozen"  # its process is stopped (SIGSTOP, a debugger): it runs no code



class EntryKind(Word):
    """What one record of the history is."""

    CELL = "cell"  # a cell run on the ranks (its code)
    PUSH = "push"  # values sent from the notebook



class WaitKind(Word):
    """What the notebook waits for: a cell's code, a function applied by name,
    or a value moved to or from the ranks (push, pull: an engine function that
    prints nothing, so its engine's "idle" status is not waited for)."""

    EXECUTE = "execute"
    APPLY = "apply"
    VALUE = "value"



@dataclass
class RankOutcome:
    """What one rank did in one cell or call."""

    rank: int
    status: Status = Status.PENDING
    value: Any = None
    ename: str = ""
    evalue: str = ""
    traceback: str = ""
    stdout: str = ""
    stderr: str = ""
    outputs: list = field(default_factory=list)
    execute_result: dict | None = None
    died: str = ""
    collective: bool = False  # the error came from a collective / the group
    note: str = ""  # deadlocked: why no rank could ever complete its collective
    notes: list = field(default_factory=list)  # dpnb's notes on the cell (calls paired across lines)
    # what the rank's hooks sent home in the cell's reply, by name (dpnb.engine.cell.outcount.CARRY_KEY)
    carry: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    @property
    def raised(self) -> bool:
        """The rank's own code (or a collective in it) raised."""
        return self.status == Status.ERROR


@dataclass
class CellResult:
    """The per-rank outcome of :meth:`Cluster.run` or :meth:`Cluster.call`."""

    ranks: list[int]
    outcomes: dict[int, RankOutcome]
    elapsed_s: float
    streamed: bool = False
    error: Exception | None = None  # set when the caller asked not to raise
    released: bool = False  # the ranks' process groups were released (must re-form)
    where: dict = field(default_factory=dict)  # rank -> where it was when stopped
    cell_timeout_s: float | None = None  # the cell's own --timeout, if it had one
    shown_live: set = field(default_factory=set)  # (rank, render.live_key) shown while running

    @property
    def ok(self) -> bool:
        return all(o.status == Status.OK for o in self.outcomes.values())

    @property
    def values(self) -> list:
        return [self.outcomes[r].value for r in self.ranks]

    @property
    def stdout(self) -> dict[int, str]:
        return {r: self.outcomes[r].stdout for r in self.ranks}


@dataclass
class Health:
    """The notebook's running view of the ranks (mutated as cells report back).

    ``dead``: rank -> how its engine ended.  ``busy``: ranks still running a
    cell the notebook stopped waiting for.  ``group_ok``: the process group
    can be used.  (How many times the group was formed is the world's:
    :class:`dpnb.cluster.worldref.World`.)
    """

    dead: dict[int, str] = field(default_factory=dict)
    busy: set[int] = field(default_factory=set)
    group_ok: bool = True
    #: every change above, in order (``%dp incidents``; the last MAX_INCIDENTS)
    incidents: deque = field(default_factory=lambda: deque(maxlen=MAX_INCIDENTS))
    hurt: bool = False  # a fault since the last "healthy" incident

    # The only writers of the fields above (tests/unit/test_layers.py holds it):
    # the transport, the group, restart and status report what happened here,
    # by name, and read the fields.
    def _saw(self, kind: str, ranks=(), detail: str = "") -> None:
        self.incidents.append(Incident(time.time(), kind, tuple(sorted(ranks)), detail))
        if kind in FAULTS:
            self.hurt = True

    def _healed(self) -> None:
        if self.hurt and self.group_ok and not self.dead and not self.busy:
            self.hurt = False
            self._saw("healthy", detail="every rank alive and idle, the process group usable")

    def died(self, r: int, how: str) -> None:
        """Rank ``r``'s engine ended (``how``: the exit as said to the user)."""
        if self.dead.get(r) != how:
            self._saw("died", (r,), how)
        self.dead[r] = how

    def still_busy(self, r: int) -> None:
        """The notebook stopped waiting for rank ``r``, which still runs a cell."""
        if r not in self.busy:
            self._saw("still busy", (r,), "the notebook stopped waiting for its call")
        self.busy.add(r)

    def settled(self, r: int) -> None:
        """Rank ``r`` finished what it was running."""
        self.busy.discard(r)
        self._healed()

    def group_broken(self, why: str = "") -> None:
        """The process group cannot be used until it is re-formed."""
        if self.group_ok:
            self._saw("group broken", detail=why)
        self.group_ok = False

    def group_formed(self, *, all_settled: bool = False) -> None:
        """A new group stands; ``all_settled``: every rank took part, so none runs an old cell."""
        was = self.group_ok
        self.group_ok = True
        if all_settled:
            self.busy.clear()
        if not was or all_settled:
            self._healed()

    def replaced(self, ranks) -> None:
        """``ranks`` are fresh engines: their death marks are history."""
        ranks = [r for r in ranks if r in self.dead]
        for r in ranks:
            self.dead.pop(r, None)
        if ranks:
            self._saw("replaced", ranks, "fresh engines")
            self._healed()

    def new_world(self) -> None:
        """A resize: every rank alive and idle."""
        self.dead.clear()
        self.busy.clear()
        self._saw("resized", detail="every rank alive and idle")
        self._healed()


@dataclass(frozen=True)
class CellRecord:
    """One thing a notebook sent to the ranks, kept for ``%dp export`` to say
    what it could and could not carry into a batch job.

    ``kind``: ``"cell"`` (``code`` run on ``ranks``, ``None`` meaning every
    rank; ``ok`` when it succeeded everywhere) or ``"push"`` (``names`` sent
    from the notebook).  ``seq``: its number among everything this cluster
    was sent, kept when older records leave the bounded history: the
    session's setup record names a ``%%dp --setup`` cell by it (the runtime
    does not know what a setup cell is).
    """

    kind: EntryKind
    code: str = ""
    ranks: tuple | None = None
    ok: bool = True
    names: tuple = ()
    seq: int = 0

    def to_record(self) -> dict:
        return {"kind": self.kind, "code": self.code,
                "ranks": list(self.ranks) if self.ranks else None,
                "ok": self.ok, "names": list(self.names), "seq": self.seq}

    @classmethod
    def from_record(cls, h: dict, seq: int = 0) -> CellRecord:
        """``seq``: the position to take when the record has none (an older dpnb's)."""
        return cls(kind=EntryKind(h["kind"]), code=h["code"], ok=h["ok"],
                   ranks=tuple(h["ranks"]) if h["ranks"] else None, names=tuple(h["names"]),
                   seq=int(h.get("seq", seq)))

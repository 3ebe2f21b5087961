"""The torch.distributed process group the ranks share: forming it, and re-forming it.

engine <-> engine traffic is torch.distributed (gloo on CPU, NCCL between
GPUs), formed with ``init_process_group(timeout=...)`` against a TCP store
that rank 0 serves.  The short timeout is what turns a peer that raised, hung
or died into an error on the waiting ranks rather than an endless hang.

A group whose collective failed cannot be trusted again, so after such an
error every rank destroys it and forms a new one on a fresh port (rank 0 opens
the new store socket first, on its own address).  The engines' namespaces --
models, optimizers, tensors -- are untouched; wrappers bound to the old group
are re-bound by callbacks the training layer registered on each engine.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from ..core.timeouts import form_timeout
from ..errors import DpnbError, StartError
from ..ranks import rank_label
from .diagnose import first_error
from .launch import rank_init_info
from .worldref import WorldRef
from .transport import Transport
from .types import Health

log = logging.getLogger(__name__)


class Group:
    """The settings of one cluster's process group and the steps that (re-)form it."""

    def __init__(self, transport: Transport, world: WorldRef, health: Health, *,
                 backend: str, master_addr: str, timeout_s: float, threads: int, local: bool,
                 env: dict[str, str] | None = None, watch_pid: int | None = None,
                 seed: int | None = None):
        self.t = transport
        # what fresh engines watch (the launcher's word): this kernel, or None --
        # engines that are this kernel's grandchildren (forked by a local zygote
        # agent) watch the agent instead, which watches this kernel
        self.watch_pid = watch_pid
        self.worlds = world  # the port and generation live in the world, replaced whole
        self.health = health
        self.backend = backend
        self.master_addr = master_addr
        self.timeout_s = timeout_s
        self.threads = threads
        self.local = local
        self.env = dict(env or {})
        # torchrun's rendezvous id, one for the cluster's life (TORCHELASTIC_RUN_ID)
        self.run_id = f"dpnb-{uuid.uuid4().hex[:12]}"
        self.seed = seed  # --seed: rank r's generators start at seed + r

    # ------------------------------------------------------------------ record
    def to_record(self) -> dict:
        """The group's settings, for a kept cluster's record (its port and
        generation are the world's)."""
        return {"backend": self.backend, "master_addr": self.master_addr,
                "timeout_s": self.timeout_s, "threads": self.threads, "seed": self.seed,
                "run_id": self.run_id}

    @staticmethod
    def settings_of(rec: dict) -> dict:
        """The settings :meth:`to_record` wrote, as the cluster's constructor takes them."""
        return {"backend": rec["backend"], "master_addr": rec["master_addr"],
                "timeout_s": float(rec["timeout_s"]), "threads": int(rec["threads"]),
                "seed": rec.get("seed")}  # older records lack the seed

    def restore(self, rec: dict) -> None:
        """Replacements join the same torchrun run as the engines they join."""
        self.run_id = rec.get("run_id") or self.run_id

    world = property(lambda self: self.worlds.now)
    ranks = property(lambda self: self.world.ranks)
    # rank 0 opens the store's socket once it has its identity (0 until then)
    master_port = property(lambda self: self.world.master_port)

    @property
    def form_wait_s(self) -> float:
        """How long the notebook waits for a (re-)formation: the engines give up
        joining after :func:`form_timeout`, then report back."""
        return form_timeout(self.timeout_s) + 15

    def init_ranks(self, new: Sequence[int] | None = None) -> None:
        """``init_rank`` on every rank, one round trip in all.

        Engines started by this kernel watch it (``watch_ppid``) and exit if
        it dies; ``new`` names the freshly started ones on a restart (``None``:
        all of them, at start).
        """
        infos = {}
        for ri in self.ranks:
            fresh = new is None or ri.rank in new
            infos[ri.rank] = (rank_init_info(
                ri, world_size=len(self.ranks), backend=self.backend,
                master_addr=self.master_addr, master_port=self.master_port,
                timeout_s=self.timeout_s, threads=self.threads, local=self.local,
                watch_ppid=self.watch_pid if fresh else None, token=self.t.token,
                env=self.env, nnodes=len({r.node_rank for r in self.ranks}), seed=self.seed,
                run_id=self.run_id),)
        res = self.t.setup_all("init_rank", per_rank=infos, timeout=60)
        if not res.ok:
            raise StartError("could not give the engines their ranks: " + first_error(res))
        opened = {r: (o.value["door"][0], int(o.value["door"][1]))
                  for r, o in res.outcomes.items() if o.value.get("door")}
        self.worlds.set(self.world.with_doors(opened))

    def check_reach(self, port: int) -> None:
        """Every rank connects to rank 0's store first (multi-host only), so an
        unreachable address fails in seconds, naming itself, not after the
        group timeout as "2/4 clients joined"."""
        if self.local:
            return
        res = self.t.setup_all("reach_store", (self.master_addr, port), timeout=30)
        if not res.ok:
            raise StartError("could not check the store address: " + first_error(res))
        bad = {r: o.value for r, o in res.outcomes.items() if not o.value.get("ok")}
        if not bad:
            return
        good = sorted(set(res.outcomes) - set(bad))
        lines = [f"rank {r} on {v.get('host')}: {v.get('error')}" for r, v in sorted(bad.items())]
        raise StartError(
            f"the process group's store at {self.master_addr}:{port} (rank 0 on "
            f"{self.ranks[0].host}) is not reachable from {rank_label(sorted(bad))}:\n  "
            + "\n  ".join(lines) + f"\n{rank_label(good) if good else 'no rank'} reached it. "
            f"Give --master-addr an address of {self.ranks[0].host} the other hosts can "
            f"reach (and --env GLOO_SOCKET_IFNAME=<its interface> if gloo must use another "
            f"interface), or check the firewall between the hosts")

    def form(self) -> None:
        """The first ``init_process_group`` on every rank, checked by an all_reduce."""
        port = self.t.setup_one(0, "listen_store", self.master_addr)
        self.worlds.set(self.world.formed(port))
        self.check_reach(port)
        res = self.t.setup_all("form_group", (self.master_port,), timeout=self.form_wait_s)
        if not res.ok:
            raise StartError("the engines started but could not form a process group: "
                             + first_error(res))
        # The preload imports end on every rank before the start returns, so
        # the first cell does not wait for them.
        self.t.setup_all("preload_done", timeout=self.form_wait_s)

    def reform_said(self, hint: str = "") -> dict:
        """``%dp reform``: :meth:`regroup` with every rank's callbacks; its
        ``message`` says what was moved to the new group and what was not."""
        info = self.regroup(callbacks=True, hint=hint)
        info["message"] = (f"process group re-formed on port {info['port']} (generation "
                           f"{info['generation']}).{moved_sentences(info)}")
        return info

    def regroup(self, *, callbacks: bool, hint: str = "") -> dict:
        """Rank 0 opens a fresh store socket, then every rank re-forms the group.

        ``callbacks``: run the re-binding callbacks (they are collectives, so
        only when every rank still holds its objects).
        """
        port = self.t.setup_one(0, "listen_store", self.master_addr)
        self.check_reach(port)
        res = self.t.setup_all("reform_group", (port, callbacks), timeout=self.form_wait_s)
        if not res.ok:
            self.health.group_broken("a re-formation failed: " + first_error(res))
            raise DpnbError("could not re-form the process group: " + first_error(res) + hint)
        self.worlds.set(self.world.formed(
            port, max(o.value["generation"] for o in res.outcomes.values())))
        self.health.group_formed()
        problems = sorted({p for o in res.outcomes.values() for p in o.value.get("problems", [])})
        rebound = res.outcomes[0].value.get("rebound", []) if 0 in res.outcomes else []
        # what one rank could not move (a name only it has) is said once, whoever found it
        left = list(dict.fromkeys(x for _, o in sorted(res.outcomes.items())
                                  for x in o.value.get("left", [])))
        return {"port": port, "generation": self.world.generation, "problems": problems,
                "rebound": rebound, "left": left}

    def reform_all(self, new: Sequence[int] = ()) -> dict:
        """Re-form the group when some ranks are fresh engines needing ``init_rank``."""
        self.init_ranks(new=list(new))
        return self.regroup(callbacks=not new)

    def try_reform(self) -> tuple[bool, str]:
        """Re-form after a failed cell; ``(done, sentence for the report)``."""
        if self.health.dead:
            return False, "some ranks died: run %dp restart instead"
        try:
            info = self.regroup(callbacks=True, hint="; try %dp restart")
        except DpnbError as e:
            log.warning("re-forming the group failed: %s", e)
            self.health.group_broken(f"a re-formation failed: {e}")
            return False, f"Re-forming the process group failed: {e}"
        return True, (f"The process group was re-formed on port {self.master_port} "
                      f"(generation {self.world.generation}); everything on the engines is "
                      f"kept.{moved_sentences(info)}")


def moved_sentences(info: dict) -> str:
    """What a re-formation moved to the new group and what it could not, as
    sentences after the one saying it happened (empty: nothing held the group)."""
    extra = ""
    if info.get("rebound"):
        extra += " Moved to the new group: " + "; ".join(info["rebound"]) + "."
    if info.get("left"):
        extra += " Not moved: " + "; ".join(info["left"]) + "."
    if info.get("problems"):
        extra += " Some wrappers could not be re-bound: " + "; ".join(info["problems"])
    return extra

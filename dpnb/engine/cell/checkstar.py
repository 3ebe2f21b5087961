"""The check connections: a star of TCP connections, rank 0 the hub.

See :mod:`dpnb.engine.cell.collcheck` for what is checked and why.  Formed on
every rank at once right after each (re-)formation of the process group: rank
0 listens on the group's store address, publishes the port in the group's
store, admits exactly one connection per other rank -- each proving it knows
the cluster's token with an HMAC of the formation and its rank -- and then
closes the listening socket, so nobody can connect later.

Who sends what, per checked call: every other rank sends ``(number,
digest, proposal, site)`` (32 bytes) to the hub; the hub compares them with
its own and answers ``(verdict, period)`` (16 bytes) to each: 0 all equal, 1
the calls differ, 2 the same call made from different lines (a cell's line 3
on one rank, line 5 on another: gloo pairs them and both results mix the
two lines' values), and the period every rank proposed (0 when they differ).
After a 1 every rank sends its readable call and receives the table of all of
them; after a 2, its line, and the call runs -- the pairing is kept for the
cell's note (or its report, if the cell then fails).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import select
import selectors
import socket
import struct
import time
from typing import Any

from dpnb.engine.cell.collcheck import (CheckReleased, CollectiveMismatchError, Pattern, site_digest,
                        site_label)

log = logging.getLogger(__name__)

_CHECK = struct.Struct("<qqqq")  # number, digest, proposed period, site
_VERDICT = struct.Struct("<qq")  # 0 same / 1 differ / 2 other lines, agreed period
_LEN = struct.Struct("<I")
_HELLO = struct.Struct("<i32s")  # rank, HMAC-SHA256(token, "formation:rank")
#: how long a connection to the hub may take to send its hello (from accept)
HELLO_S = 5.0
#: cap on a readable call or table sent after a mismatch
MAX_TABLE_BYTES = 1 << 20
#: pairings across lines kept per cell (the note shows a few)
MAX_MOVED = 64


def _recv_exact(sock: socket.socket, n: int, peer: str = "a peer") -> bytes:
    """``n`` bytes from ``sock``.  Waiting here is waiting for a peer in a
    collective, and ends as gloo's wait does: at the group timeout (the
    socket's timeout), or when a release shuts the connection.  Ctrl-C (or the
    notebook's interrupt at a cell timeout) ends it as a collective error, not
    as this rank's own KeyboardInterrupt: the rank was only waiting."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            raise CheckReleased(f"Timed out after {sock.gettimeout():g} s (the group timeout) "
                                f"waiting for {peer} in dpnb's collective check") from None
        except KeyboardInterrupt:
            raise CheckReleased(f"interrupted while waiting for {peer} in dpnb's collective "
                                f"check") from None
        if not chunk:
            raise CheckReleased("Connection closed by peer during dpnb's collective check "
                                "(the group was released, or a peer's engine is gone)")
        buf += chunk
    return bytes(buf)


def _send_blob(sock: socket.socket, obj: Any) -> None:
    data = json.dumps(obj).encode()[:MAX_TABLE_BYTES]
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_blob(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_TABLE_BYTES:
        raise CheckReleased(f"collective check: a {n}-byte table is over the limit")
    return json.loads(_recv_exact(sock, n))


def _hello_mac(token: str, formation: int, rank: int) -> bytes:
    return hmac.new(token.encode(), f"{formation}:{rank}".encode(), hashlib.sha256).digest()


class Star:
    """One rank's end of the check connections of one group formation."""

    def __init__(self, rank: int, world: int, spokes: dict[int, socket.socket],
                 hub: socket.socket | None, timeout_s: float | None = None):
        self.rank, self.world = rank, world
        self.spokes = spokes  # rank 0: other rank -> its connection
        self.hub = hub  # other ranks: the connection to rank 0
        self.set_timeout(timeout_s)
        self.seq = 0  # calls on the default group since it formed, checked or not
        self.pattern = Pattern()
        # this cell's calls paired across lines: every rank's table (checked
        # calls) and this rank's own skipped calls whose line moved
        self.paired: list[dict] = []
        self.moved: list[dict] = []
        self.broken: str | None = None  # why the channel cannot be trusted any more
        # while a check waits: the hub, the ranks not heard from yet; another
        # rank, True until its verdict is in (read by the side door's where)
        self._awaiting: tuple[int, ...] | bool = ()

    def set_timeout(self, timeout_s: float | None) -> None:
        """How long a check waits for a peer: as long as gloo would (the group
        timeout; a script's ``init_process_group(timeout=...)`` for its run)."""
        for sock in [*self.spokes.values(), *([self.hub] if self.hub is not None else [])]:
            sock.settimeout(timeout_s)

    # -- formation (every rank at once, right after the group formed) -------
    @classmethod
    def form(cls, store, rank: int, world: int, addr: str, token: str, formation: int,
             timeout_s: float) -> "Star":
        """Every rank at once; ``formation`` names this formation of the group (the
        same number on every rank), so an old hello cannot be replayed."""
        key = f"dpnb/collcheck/{formation}"
        if world == 1:
            return cls(rank, world, {}, None)
        if rank == 0:
            return cls._form_hub(store, key, world, addr, token, formation, timeout_s)
        port = int(store.get(key).decode())
        s = socket.create_connection((addr, port), timeout=timeout_s)
        s.sendall(_HELLO.pack(rank, _hello_mac(token, formation, rank)))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(rank, world, {}, s, timeout_s)

    @classmethod
    def _form_hub(cls, store, key, world, addr, token, formation, timeout_s) -> "Star":
        """Admit one authenticated connection per other rank.  Connections are
        read side by side (a selector), each with its own short deadline, so a
        stranger that connects and stays silent delays no rank's hello."""
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        lsock = socket.socket(family, socket.SOCK_STREAM)
        spokes: dict[int, socket.socket] = {}
        pending: dict[socket.socket, list] = {}  # conn -> [peer, bytes so far, deadline]
        sel = selectors.DefaultSelector()
        try:
            lsock.bind((addr, 0))
            lsock.listen(max(world, 64))
            lsock.setblocking(False)
            sel.register(lsock, selectors.EVENT_READ)
            store.set(key, str(lsock.getsockname()[1]))
            deadline = time.monotonic() + timeout_s
            while len(spokes) < world - 1:
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(f"collective check: {world - 1 - len(spokes)} ranks did "
                                       f"not connect within {timeout_s:g} s")
                wake = min([deadline, *(p[2] for p in pending.values())])
                for k, _ in sel.select(max(wake - now, 0.0)):
                    if k.fileobj is lsock:
                        cls._accept(lsock, sel, pending, min(deadline, now + HELLO_S))
                    else:
                        cls._read_hello(k.fileobj, sel, pending, spokes, world, token, formation)
                now = time.monotonic()
                for conn in [c for c, p in pending.items() if p[2] < now]:
                    cls._drop(conn, sel, pending, f"no hello within {HELLO_S:g} s")
        except BaseException:
            for c in spokes.values():
                c.close()
            raise
        finally:
            for c in list(pending):
                c.close()
            sel.close()
            lsock.close()  # nobody can connect once every rank has
        return cls(0, world, spokes, None, timeout_s)

    @staticmethod
    def _accept(lsock, sel, pending, deadline) -> None:
        try:
            conn, peer = lsock.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        sel.register(conn, selectors.EVENT_READ)
        pending[conn] = [peer, b"", deadline]

    @staticmethod
    def _drop(conn, sel, pending, why: str) -> None:
        peer = pending.pop(conn)[0]
        sel.unregister(conn)
        conn.close()
        log.warning("collective check: dropped a connection from %s: %s", peer, why)

    @classmethod
    def _read_hello(cls, conn, sel, pending, spokes, world, token, formation) -> None:
        """More of a pending connection's hello; admit it once complete and right."""
        peer, buf, _ = p = pending[conn]
        try:
            chunk = conn.recv(_HELLO.size - len(buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            return cls._drop(conn, sel, pending, str(e))
        if not chunk:
            return cls._drop(conn, sel, pending, "closed before its hello")
        p[1] = buf = buf + chunk
        if len(buf) < _HELLO.size:
            return
        r, mac = _HELLO.unpack(buf)
        if not (0 < r < world and r not in spokes
                and hmac.compare_digest(mac, _hello_mac(token, formation, r))):
            return cls._drop(conn, sel, pending, "bad hello")
        pending.pop(conn)
        sel.unregister(conn)
        conn.setblocking(True)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        spokes[r] = conn

    # -- one call -----------------------------------------------------------
    def reset_cell(self) -> None:
        """A new cell: its calls' history and pairings start afresh (every rank)."""
        self.pattern.reset()
        self.paired, self.moved = [], []

    def call(self, op: str, text: str, digest: int, site: tuple | None = None) -> bool:
        """Number this call; check it against every rank's unless it repeats the
        agreed period.  Raises :class:`CollectiveMismatchError` on a mismatch;
        ``site`` is the user's ``(file, line)`` (:func:`collcheck.site_key`),
        compared too: calls paired across lines are kept in :attr:`paired`.
        True if checked."""
        self.seq += 1
        pattern = self.pattern
        if self.world == 1:
            return False
        if pattern.repeats(digest):
            before = pattern.moved(site)
            if before is not None and len(self.moved) < MAX_MOVED:
                self.moved.append({"rank": self.rank, "op": op, "seq": self.seq,
                                   "at": site_label(site), "before": site_label(before)})
            pattern.record(digest, site=site)
            return False
        if self.broken:
            raise CheckReleased(f"dpnb's collective check cannot continue ({self.broken}); the "
                                f"group is re-formed after this cell (or run %dp reform)")
        proposal = pattern.proposal(digest, site)
        mine = (self.seq, digest, proposal, site_digest(site))
        try:
            verdict, period = self._hub_round(mine) if self.rank == 0 else self._spoke_round(mine)
            if verdict != 1:
                pattern.record(digest, period, site)
                if verdict == 2:
                    table = self._tables({"at": site_label(site)})
                    if len(self.paired) < MAX_MOVED:
                        self.paired.append({"op": op, "seq": self.seq, "sites": {
                            int(r): t["at"] for r, t in table.items()}})
                return True
            table = self._tables({"call": text, "at": site_label(site) if site else "",
                                  "check": self.seq})
        except OSError as e:  # a send on a connection a release shut
            self.broken = f"{type(e).__name__} during call #{self.seq}"
            raise CheckReleased(f"Connection closed by peer during dpnb's collective check "
                                f"({e})") from None
        except BaseException as e:
            # a half-done exchange leaves the peers' streams out of step
            self.broken = f"{type(e).__name__} during call #{self.seq}"
            raise
        finally:
            self._awaiting = ()
        raise CollectiveMismatchError(op, {int(r): t for r, t in table.items()})

    def awaiting(self) -> list[int] | None:
        """Who this rank's check waits for now: rank 0, the ranks whose call has
        not arrived; another rank, ``[0]`` while its verdict is not in (and not
        merely unread); None when not waiting.  Safe from another thread."""
        a = self._awaiting
        if a is True:
            hub = self.hub
            try:
                ready = hub is not None and bool(select.select([hub], [], [], 0)[0])
            except (OSError, ValueError):  # closed meanwhile
                ready = True
            return None if ready else [0]
        return list(a) if a else None

    def _spoke_round(self, mine: tuple) -> tuple[int, int]:
        self.hub.sendall(_CHECK.pack(*mine))
        self._awaiting = True
        return _VERDICT.unpack(_recv_exact(self.hub, _VERDICT.size, "rank 0"))

    def _hub_round(self, mine: tuple) -> tuple[int, int]:
        """Compare every rank's (number, call) -- the verdict -- and its proposal
        and site, which only decide the period and whether lines are named."""
        same, other_line, agreed, order = True, False, mine[2], sorted(self.spokes)
        for i, r in enumerate(order):
            self._awaiting = tuple(order[i:])
            seq, dig, prop, site = _CHECK.unpack(_recv_exact(self.spokes[r], _CHECK.size,
                                                             f"rank {r}"))
            same = same and (seq, dig) == mine[:2]
            agreed = agreed if prop == agreed else 0
            other_line = other_line or site != mine[3]
        self._awaiting = ()
        verdict = (0 if not other_line else 2, agreed) if same else (1, 0)
        out = _VERDICT.pack(*verdict)
        for r in order:
            self.spokes[r].sendall(out)
        return verdict

    def _tables(self, info: dict) -> dict:
        if self.rank != 0:
            _send_blob(self.hub, info)
            return _recv_blob(self.hub)
        table = {0: info}
        for r in sorted(self.spokes):
            table[r] = _recv_blob(self.spokes[r])
        for r in sorted(self.spokes):
            _send_blob(self.spokes[r], table)
        return table

    def close(self) -> None:
        for s in [*self.spokes.values(), *([self.hub] if self.hub else [])]:
            try:
                s.close()
            except OSError as e:  # already shut by a release
                log.debug("closing a check connection: %s", e)
        self.spokes, self.hub = {}, None
        self.broken = "closed"

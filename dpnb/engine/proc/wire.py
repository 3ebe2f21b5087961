"""How dpnb's own listeners tell the cluster's owner from a stranger.

Every socket dpnb listens on -- rank 0's rendezvous store
(:mod:`dpnb.engine.group.authstore`) and each engine's side door
(:mod:`dpnb.engine.sidedoor`) -- opens a connection the same way:

1. the server sends a fresh 32-byte nonce;
2. the client sends its own nonce and ``HMAC-SHA256(token, "c" + both)``;
3. the server checks it and answers ``HMAC-SHA256(token, "s" + both)``,
   which the client checks in turn.

The token is the cluster's secret (``Transport.token``, which the notebook
gives each engine through ipyparallel's signed channel); it never crosses the
wire, so someone who can watch the cluster network cannot replay it, and a
client never talks to an impostor that took a port.  After the handshake,
requests are length-prefixed frames with a size cap.

What a stranger can cost a server: nothing before the handshake reads more
than 64 bytes, and the whole handshake has one deadline from ``accept``
(:data:`HANDSHAKE_S`), not one per read -- a client that dribbles a byte a
second is dropped like a silent one.  The servers are asyncio loops in one
daemon thread each, so a slow connection never delays another one.  Refusals
are logged, at most once a minute per listener (:class:`Refusals`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

NONCE = 32
#: the whole handshake, from accept; a real client answers in microseconds
HANDSHAKE_S = 5.0
_LEN = struct.Struct("<I")


class WireError(OSError):
    """The other end is not who it should be, or broke the protocol."""


def mac(token: str, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token.encode(), side + server_nonce + client_nonce, hashlib.sha256).digest()


# -- the client side: blocking sockets ----------------------------------------
def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise WireError("connection closed by the server")
        buf += chunk
    return bytes(buf)


def client_handshake(sock: socket.socket, token: str) -> None:
    """Prove the token to the server and check that the server knows it too."""
    server_nonce = recv_exact(sock, NONCE)
    mine = os.urandom(NONCE)
    sock.sendall(mine + mac(token, b"c", server_nonce, mine))
    if not hmac.compare_digest(recv_exact(sock, 32), mac(token, b"s", server_nonce, mine)):
        raise WireError("the server does not know the cluster's token")


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_frame(sock: socket.socket, limit: int) -> bytes:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > limit:
        raise WireError(f"a {n}-byte frame is over the {limit}-byte limit")
    return recv_exact(sock, n)


def connect(addr: str, port: int, timeout: float) -> socket.socket:
    """A connected socket: ``addr`` starting with ``/`` is a UNIX socket path."""
    if addr.startswith("/"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(addr)
        except BaseException:
            s.close()
            raise
        return s
    s = socket.create_connection((addr, port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


# -- the server side: asyncio ---------------------------------------------------
class Refusals:
    """Log refused connections at most once per ``every`` seconds per listener,
    with the count of those not logged."""

    def __init__(self, what: str, every: float = 60.0):
        self.what, self.every = what, every
        self.last = -every
        self.quiet = 0
        self.total = 0

    def note(self, peer, why: str) -> None:
        self.total += 1
        now = time.monotonic()
        if now - self.last < self.every:
            self.quiet += 1
            return
        more = f" ({self.quiet} more since the last report)" if self.quiet else ""
        log.warning("%s: refused a connection from %s: %s%s", self.what, peer or "a local "
                    "process", why, more)
        self.last, self.quiet = now, 0


async def server_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           token: str, deadline: float) -> None:
    """Check the client's proof and give ours; WireError (or TimeoutError) if it fails."""
    loop = asyncio.get_running_loop()
    nonce = os.urandom(NONCE)
    writer.write(nonce)
    left = deadline - loop.time()
    data = await asyncio.wait_for(reader.readexactly(NONCE + 32), max(left, 0.001))
    theirs, proof = data[:NONCE], data[NONCE:]
    if not hmac.compare_digest(proof, mac(token, b"c", nonce, theirs)):
        raise WireError("wrong token")
    writer.write(mac(token, b"s", nonce, theirs))
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader, limit: int) -> bytes | None:
    """The next frame, or None at a clean end of the connection."""
    try:
        head = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise WireError("connection closed inside a frame") from None
        return None
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise WireError(f"a {n}-byte frame is over the {limit}-byte limit")
    return await reader.readexactly(n)


def frame(data: bytes) -> bytes:
    return _LEN.pack(len(data)) + data


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server(threading.Thread):
    """An asyncio server on an already bound, listening socket, in a daemon thread.

    Each connection first passes the handshake within :data:`HANDSHAKE_S`
    of its accept, then ``serve(reader, writer)`` runs for it; connections
    are independent, so a stalled one delays no other.
    """

    def __init__(self, name: str, sock: socket.socket, token: str, serve: Handler):
        super().__init__(name=name, daemon=True)
        self.sock, self.token, self.serve = sock, token, serve
        self.refusals = Refusals(name)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self.failed: Exception | None = None

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start())
        except Exception as e:  # handed to start(), which raises it in the caller
            self.failed = e
            return
        finally:
            self._ready.set()
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    async def _start(self) -> None:
        start = asyncio.start_unix_server if self.sock.family == socket.AF_UNIX \
            else asyncio.start_server
        self._server = await start(self._connection, sock=self.sock, limit=1 << 16)

    def start(self) -> None:
        super().start()
        if not self._ready.wait(10):
            raise WireError(f"{self.name}: the server thread did not start within 10 s")
        if self.failed is not None:
            raise WireError(f"{self.name}: could not serve: {self.failed}") from self.failed

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        try:
            await self._handle(reader, writer)
        except asyncio.CancelledError:
            # close() ends the connections it finds open: a normal end here
            # (asyncio's stream callback reports a cancelled handler as an error)
            log.debug("%s: connection closed with the server", self.name)
        finally:
            self._open.discard(writer)
            writer.close()
            try:  # collect how the connection ended (else asyncio reports it at exit)
                await writer.wait_closed()
            except (OSError, asyncio.CancelledError) as e:
                log.debug("%s: connection closed: %s", self.name, e)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        loop = asyncio.get_running_loop()
        try:
            await server_handshake(reader, writer, self.token, loop.time() + HANDSHAKE_S)
        except asyncio.IncompleteReadError as e:
            if e.partial:  # gave some bytes, then left: not one of ours
                self.refusals.note(peer, "closed during the handshake")
            else:  # a reachability probe (connect, close): nothing to report
                log.debug("%s: %s connected and left", self.name, peer)
            return
        except (asyncio.TimeoutError, WireError, OSError) as e:
            self.refusals.note(peer, "no handshake within "
                               f"{HANDSHAKE_S:g} s" if isinstance(e, asyncio.TimeoutError)
                               else str(e) or type(e).__name__)
            return
        try:
            await self.serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            log.debug("%s: connection from %s ended: %s", self.name, peer, e)
        except WireError as e:  # an authenticated client broke the protocol
            log.warning("%s: dropped a connection from %s: %s", self.name, peer, e)

    def close(self) -> None:
        """Stop listening and end every connection (from any thread)."""
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._open):
                w.transport.abort()
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.loop.stop()

        if self.is_alive() and not self.loop.is_closed():
            try:
                asyncio.run_coroutine_threadsafe(stop(), self.loop)
            except RuntimeError as e:  # the loop closed meanwhile
                log.debug("%s already stopped: %s", self.name, e)
            self.join(5)
        self.sock.close()

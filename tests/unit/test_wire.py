"""dpnb's listeners in one process: the authenticated store and a TCP side door.

The store's operations are checked against torch's ``TCPStore`` semantics
(blocking ``get``/``wait``, ``add`` from zero, ``compare_set`` on a missing
key); strangers -- wrong token, silence, a byte at a time, an endless line --
are dropped within the handshake deadline while a real client is answered at
once.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from dpnb.cluster.sidedoor import knock
from dpnb.engine.proc import wire
from dpnb.engine.group.authstore import AuthStore, StoreServer
from dpnb.engine.sidedoor import SideDoor

TOKEN = "a-cluster-secret"


@pytest.fixture
def server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    srv = StoreServer(sock, TOKEN)
    yield srv
    srv.close()


def _client(srv, token=TOKEN, timeout_s=5.0):
    return AuthStore("127.0.0.1", srv.port, token, timedelta(seconds=timeout_s))


def test_store_operations_match_tcpstore(server):
    a, b = _client(server), _client(server)
    a.set("k", b"v")
    assert b.get("k") == b"v"
    assert a.add("n", 2) == 2 and b.add("n", 3) == 5
    assert a.compare_set("c", "", "first") == b"first"        # missing + empty expected: set
    assert a.compare_set("c", "wrong", "x") == b"first"        # mismatch: current value
    assert a.compare_set("c", "first", "second") == b"second"
    assert a.compare_set("missing", "exp", "x") == b"exp"      # TCPStore's answer
    assert a.check(["k", "n"]) and not a.check(["k", "nope"])
    assert a.num_keys() == 3
    assert a.delete_key("k") and not a.delete_key("k")


def test_get_blocks_until_another_rank_sets_and_wait_times_out(server):
    a, b = _client(server), _client(server, timeout_s=0.5)
    threading.Timer(0.3, lambda: a.set("late", b"1")).start()
    t0 = time.monotonic()
    assert b.get("late") == b"1"
    assert 0.2 < time.monotonic() - t0 < 2
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="wait timeout"):
        b.wait(["never"], timedelta(seconds=0.3))
    assert time.monotonic() - t0 < 2


def test_wrong_token_is_refused_both_ways(server):
    with pytest.raises((wire.WireError, OSError)):
        _client(server, token="guess")
    # a server that does not know the token is refused by the client, too
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    impostor = StoreServer(sock, "other")
    try:
        with pytest.raises((wire.WireError, OSError)):
            AuthStore("127.0.0.1", impostor.port, TOKEN, timedelta(seconds=2))
    finally:
        impostor.close()


def _raw_wrong_proof(addr, port, request: bytes) -> bytes:
    """Play a client that holds a wrong token but does not check the server's
    proof itself (as :func:`wire.client_handshake` would): what comes back?"""
    with wire.connect(addr, port, 2.0) as s:
        nonce = wire.recv_exact(s, wire.NONCE)
        mine = b"n" * wire.NONCE
        s.sendall(mine + wire.mac("guess", b"c", nonce, mine) + request)
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except ConnectionResetError:
            pass  # closed with our unread request in its buffer: a reset, no answer
        return got


def test_the_servers_answer_nothing_to_a_wrong_proof_and_close(server):
    """The server side of the handshake: a raw client with a wrong token gets no
    proof back and no answer to its request, only the closed connection."""
    door = SideDoor(SimpleNamespace(rank=3), "127.0.0.1", TOKEN, keep=set())
    door.start()
    try:
        asks = [(door.address, wire.frame(b'{"cmd": "where"}')),
                (("127.0.0.1", server.port), wire.frame(b"N"))]
        for (addr, port), request in asks:
            assert _raw_wrong_proof(addr, port, request) == b"", (addr, port)
        # the same raw client with the right token is answered: the check above is the proof's
        with wire.connect(*door.address, 2.0) as s:
            nonce = wire.recv_exact(s, wire.NONCE)
            mine = b"n" * wire.NONCE
            s.sendall(mine + wire.mac(TOKEN, b"c", nonce, mine) + wire.frame(b'{"cmd": "where"}'))
            assert wire.recv_exact(s, 32) == wire.mac(TOKEN, b"s", nonce, mine)
            assert json.loads(wire.recv_frame(s, 1 << 20))["rank"] == 3
    finally:
        door.close()


def _stall(port: int, kind: str, stop: threading.Event) -> None:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=2)
    except OSError:
        return
    try:
        while not stop.is_set():
            if kind == "dribble":
                s.sendall(b"{")
                time.sleep(0.5)
            elif kind == "huge":
                s.sendall(b"x" * (1 << 20))
            else:
                time.sleep(0.1)
    except OSError:
        pass  # the server hung up on us: what it should do
    finally:
        s.close()


def _attack(port: int, n: int = 10):
    stop = threading.Event()
    ts = [threading.Thread(target=_stall, args=(port, k, stop), daemon=True)
          for k in ["silent"] * n + ["dribble"] * n + ["huge"] * 2]
    for t in ts:
        t.start()
    time.sleep(0.3)
    return stop, ts


def test_strangers_do_not_delay_the_store(server, monkeypatch):
    monkeypatch.setattr(wire, "HANDSHAKE_S", 1.0)
    stop, ts = _attack(server.port)
    try:
        t0 = time.monotonic()
        c = _client(server)
        c.set("x", b"1")
        assert c.get("x") == b"1"
        assert time.monotonic() - t0 < 0.5
        # every stranger is gone after the deadline, whatever it sent
        time.sleep(1.5)
        assert server.server.refusals.total >= 20, server.server.refusals.total
        assert len(server.server._open) == 1, len(server.server._open)  # c's alone
    finally:
        stop.set()
        for t in ts:
            t.join(5)


def test_tcp_side_door_answers_under_attack(monkeypatch):
    monkeypatch.setattr(wire, "HANDSHAKE_S", 1.0)
    door = SideDoor(SimpleNamespace(rank=3), "127.0.0.1", TOKEN, keep=set())
    door.start()
    try:
        addr, port = door.address
        stop, ts = _attack(port)
        try:
            t0 = time.monotonic()
            ans = knock(addr, port, TOKEN, "where", timeout=2.0)
            assert ans is not None and ans["rank"] == 3, ans
            assert time.monotonic() - t0 < 0.5
            assert knock(addr, port, "guess", "where", timeout=2.0) is None
            # a request over the size limit is refused, not read
            with wire.connect(addr, port, 2.0) as s:
                wire.client_handshake(s, TOKEN)
                s.sendall(wire._LEN.pack(10 << 20) + b"x" * 1024)
                try:
                    assert s.recv(16) == b""
                except ConnectionResetError:
                    pass  # closed with our unread bytes in its buffer: a reset
        finally:
            stop.set()
            for t in ts:
                t.join(5)
    finally:
        door.close()


def test_refusals_are_logged_at_most_once_a_minute():
    import logging

    got: list[str] = []
    h = logging.Handler()
    h.emit = lambda rec: got.append(rec.getMessage())
    logger = logging.getLogger("dpnb.engine.proc.wire")
    logger.addHandler(h)
    try:
        r = wire.Refusals("test-listener", every=60)
        for i in range(50):
            r.note(("10.0.0.9", i), "wrong token")
    finally:
        logger.removeHandler(h)
    lines = [x for x in got if "refused a connection" in x]
    assert len(lines) == 1 and r.total == 50 and r.quiet == 49, got

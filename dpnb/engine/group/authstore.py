"""The process group's rendezvous store, open only to the cluster's ranks.

Every rank forms the group through a key-value store: gloo publishes each
rank's listening address there and reads its peers', NCCL its unique id,
``new_group`` its own keys, dpnb's check star the hub's port.  torch's
``TCPStore`` has no authentication at all: any local user (or any host on the
network, for a multi-host cluster) that reaches rank 0's port can list the
keys and rewrite them -- and a rewritten address key makes a rank connect its
gloo pair to the stranger's listener.

So rank 0 serves this store instead: the same operations, the same blocking
semantics (``get`` and ``wait`` wait up to the group timeout for keys to
appear), on the socket rank 0 bound for it (:func:`dpnb.engine.setup.listen_store`),
but every connection first proves it holds the cluster's token
(:mod:`dpnb.engine.proc.wire`).  Each rank's :class:`AuthStore` is a
``torch.distributed.Store`` written in Python: torch's pybind trampoline
calls it from C++ (gloo, NCCL, ``new_group``) like any store.

Who talks to whom: every rank (rank 0 included) keeps one connection to rank
0's server per store object for the life of the group; requests are one
frame each way, serialised per connection by a lock.  gloo uses the store
only while groups form.  NCCL's heartbeat monitor, with dumps on timeout on
(torch's default), checks the default group's store for a dump signal every
``TORCH_NCCL_COORD_CHECK_MILSEC`` (1 s) while no NCCL work was added or
finished for a watchdog sleep -- between cells, and during long Python-only
stretches of a loop; the watchdog sets keys through it on a timeout.  Each
such call goes through Python on both ends: about 70 µs with the GIL free,
about 10 ms when Python threads hold it (TCPStore: about 50 µs either way;
``benchmarks/store.py --calls``).  ``TORCH_NCCL_DUMP_ON_TIMEOUT=0`` ends the
polling, ``TORCH_NCCL_ENABLE_MONITORING=0`` the monitor.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from dpnb.engine.proc import wire

log = logging.getLogger(__name__)

#: a value or request larger than this is refused (gloo's and NCCL's are < 1 KiB)
MAX_FRAME = 64 << 20
_N = struct.Struct("<I")
_OK, _ERR = b"\x00", b"\x01"


def pack(*fields: bytes) -> bytes:
    return b"".join(_N.pack(len(f)) + f for f in fields)


def unpack(data: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        if i + _N.size > len(data):
            raise wire.WireError("truncated field")
        (n,) = _N.unpack_from(data, i)
        i += _N.size
        if i + n > len(data):
            raise wire.WireError("truncated field")
        out.append(data[i:i + n])
        i += n
    return out


def _b(v) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode()
    return bytes(v)  # a list of ints from the C++ side


class StoreServer:
    """Rank 0's store: the keys, and the asyncio server that serves them."""

    def __init__(self, sock: socket.socket, token: str):
        self.data: dict[bytes, bytes] = {}
        self._events: dict[bytes, asyncio.Event] = {}  # awaited keys (server's loop only)
        self.server = wire.Server("dpnb-store", sock, token, self._serve)
        self.server.start()

    @property
    def port(self) -> int:
        return self.server.sock.getsockname()[1]

    def close(self) -> None:
        self.server.close()

    async def _wait_for(self, keys: list[bytes], timeout_s: float) -> bool:
        """Until every key is set (True) or ``timeout_s`` passed (False).  One
        event per awaited key: a ``set`` wakes only those waiting for it."""
        async def present() -> None:
            for k in keys:
                while k not in self.data:
                    ev = self._events.get(k)
                    if ev is None:
                        ev = self._events[k] = asyncio.Event()
                    await ev.wait()

        try:
            await asyncio.wait_for(present(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def _changed(self, key: bytes) -> None:
        ev = self._events.pop(key, None)
        if ev is not None:
            ev.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            req = await wire.read_frame(reader, MAX_FRAME)
            if req is None:
                return
            if not req:
                raise wire.WireError("empty request")
            try:
                out = _OK + pack(*await self._do(req[:1], unpack(req[1:])))
            except (wire.WireError, ValueError, IndexError) as e:
                out = _ERR + str(e).encode()
            writer.write(wire.frame(out))
            await writer.drain()

    async def _do(self, op: bytes, f: list[bytes]) -> list[bytes]:
        d = self.data
        if op == b"S":
            d[f[0]] = f[1]
            self._changed(f[0])
            return []
        if op == b"G":
            if not await self._wait_for([f[0]], float(f[1])):
                raise wire.WireError(f"wait timeout after {float(f[1]) * 1000:.0f}ms, "
                                     f"keys: {f[0].decode(errors='replace')}")
            return [d[f[0]]]
        if op == b"A":
            v = int(d.get(f[0], b"0")) + int(f[1])
            d[f[0]] = str(v).encode()
            self._changed(f[0])
            return [d[f[0]]]
        if op == b"C":  # compare_set, with TCPStore's rules for a missing key
            key, expected, desired = f
            cur = d.get(key)
            if (cur is None and not expected) or cur == expected:
                d[key] = desired
                self._changed(key)
                return [desired]
            return [expected if cur is None else cur]
        if op == b"W":
            keys, timeout_s = f[:-1], float(f[-1])
            if not await self._wait_for(keys, timeout_s):
                raise wire.WireError(f"wait timeout after {timeout_s * 1000:.0f}ms, keys: "
                                     + ", ".join(k.decode(errors="replace") for k in keys))
            return []
        if op == b"K":
            return [b"1" if all(k in d for k in f) else b"0"]
        if op == b"D":
            return [b"1" if d.pop(f[0], None) is not None else b"0"]
        if op == b"N":
            return [str(len(d)).encode()]
        raise wire.WireError(f"unknown store request {op!r}")


class AuthStore(dist.Store):
    """One rank's client of rank 0's :class:`StoreServer`.

    torch keeps only the C++ half of a store written in Python: whoever
    passes one to ``init_process_group`` must keep the Python object alive
    as long as the group (the engine state does), or torch's next call finds
    no method ("Not implemented")."""

    def __init__(self, addr: str, port: int, token: str, timeout: timedelta):
        super().__init__()
        self.set_timeout(timeout)
        self._where = (addr, int(port), token)
        self._clones: list[AuthStore] = []
        self._lock = threading.Lock()
        self._sock = self._connect(addr, int(port), token, timeout.total_seconds())

    @staticmethod
    def _connect(addr: str, port: int, token: str, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                s = wire.connect(addr, port, timeout_s)
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            try:
                wire.client_handshake(s, token)
            except BaseException:
                s.close()
                raise
            s.settimeout(None)  # each request sets its own wait
            return s

    def _ask(self, op: bytes, *fields: bytes, wait_s: float = 0.0) -> list[bytes]:
        with self._lock:
            # the server answers a get/wait within wait_s; a dead server is
            # noticed a little later than that, never never
            self._sock.settimeout(wait_s + self.timeout.total_seconds() + 5.0)
            wire.send_frame(self._sock, op + pack(*fields))
            resp = wire.recv_frame(self._sock, MAX_FRAME)
        if resp[:1] != _OK:
            raise RuntimeError(resp[1:].decode(errors="replace"))
        return unpack(resp[1:])

    def _wait_s(self, timeout=None) -> float:
        t = self.timeout if timeout is None else timeout
        return t.total_seconds() if isinstance(t, timedelta) else float(t)

    # -- torch.distributed.Store ---------------------------------------------
    def set(self, key, value) -> None:
        self._ask(b"S", _b(key), _b(value))

    def get(self, key) -> bytes:
        w = self._wait_s()
        return self._ask(b"G", _b(key), str(w).encode(), wait_s=w)[0]

    def add(self, key, value: int) -> int:
        return int(self._ask(b"A", _b(key), str(int(value)).encode())[0])

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        return self._ask(b"C", _b(key), _b(expected_value), _b(desired_value))[0]

    def wait(self, keys, timeout=None) -> None:
        w = self._wait_s(timeout)
        self._ask(b"W", *[_b(k) for k in keys], str(w).encode(), wait_s=w)

    def check(self, keys) -> bool:
        return self._ask(b"K", *[_b(k) for k in keys])[0] == b"1"

    def delete_key(self, key) -> bool:
        return self._ask(b"D", _b(key))[0] == b"1"

    def num_keys(self) -> int:
        return int(self._ask(b"N")[0])

    def clone(self) -> "AuthStore":
        """A second client of the same server, on its own connection.  Kept
        here: torch holds only the C++ half of what it is given."""
        twin = AuthStore(*self._where, self.timeout)
        self._clones.append(twin)
        return twin

    def close(self) -> None:
        self._sock.close()

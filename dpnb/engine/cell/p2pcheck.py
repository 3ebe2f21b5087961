"""Point-to-point calls checked between their two ranks before the data moves.

gloo aborts the receiving engine (SIGABRT) when a message is larger than the
buffer posted for it -- a hand-written ring all-reduce over uneven chunks
with one index off costs an engine and everything on it -- and fills a larger
buffer only partly, silently.  So in a checked ``%%dp`` cell, on a gloo
default group, every ``send`` / ``isend`` first sends a small *header* (128
bytes: the tensor's size, dtype and shape, and the user's line) to its peer
on a tag of its own, then the data as the user asked; every ``recv`` /
``irecv`` first receives the header, compares, and only then posts the
receive of the data.  The k-th send from rank a to rank b therefore pairs
with b's k-th recv from a, exactly as gloo pairs the data.  On a difference
the receiver takes the sender's data into a buffer of the sender's size (so
the sender's call completes and both streams stay in step) and raises
:class:`PointToPointMismatchError`, naming both ranks, lines, sizes and
dtypes; no engine dies.  ``batch_isend_irecv`` goes through the same calls.

Sends never wait for the peer (as without the check); an ``irecv`` returns at
once and a per-source thread posts its data receive when the header is in,
so code that posts receives before sends (a halo exchange) keeps working.
``recv(src=None)`` / ``irecv(src=None)`` (any source) are checked against the
first header that arrives from any rank -- the same sender gloo would have
matched -- and then receive the data from that rank.  Both sides of a pair
must be checked alike: ``%%dp --unchecked`` applies to every rank's cell.
Calls on other groups, other threads, NCCL or device tensors are not checked.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import struct
import threading
from typing import Any

import torch

from dpnb.compat import source_rank
from dpnb.engine.cell.collcheck import site_label

log = logging.getLogger(__name__)

#: the header: magic, numel, dtype index, line, has a site, ndim, 6 dims, file name
_HEAD = struct.Struct("<4sqhiBB6q40s")
META_BYTES = 128
MAGIC = b"dpP2"
#: the headers' tag: the user's tag with this bit set (gloo pairs per peer and tag)
META_TAG_BIT = 1 << 30
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128]


class PointToPointMismatchError(RuntimeError):
    """A recv's buffer and its sender's tensor differ in size or dtype; nothing was received."""


def _header(t: torch.Tensor, site: tuple | None) -> torch.Tensor:
    dims = list(t.shape)[:6] + [0] * (6 - min(t.dim(), 6))
    name, line = (site or ("", 0))
    dt = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
    raw = _HEAD.pack(MAGIC, t.numel(), dt, int(line), site is not None, t.dim(), *dims,
                     str(name)[-40:].encode("utf-8", "replace"))
    return torch.frombuffer(bytearray(raw.ljust(META_BYTES, b"\0")), dtype=torch.uint8)


def _read(buf: torch.Tensor) -> dict:
    magic, numel, dt, line, has, ndim, *rest = _HEAD.unpack(bytes(buf.numpy())[:_HEAD.size])
    if magic != MAGIC:
        raise PointToPointMismatchError("a point-to-point header was garbled (a peer's send "
                                        "was not checked? run both sides' cells alike)")
    name = rest[6].rstrip(b"\0").decode("utf-8", "replace")
    return {"numel": numel, "dtype": _DTYPES[dt] if 0 <= dt < len(_DTYPES) else None,
            "shape": list(rest[:min(ndim, 6)]), "at": site_label((name, line) if has else None)}


def _what(numel: int, dtype: Any, shape: list) -> str:
    return f"{numel} {str(dtype).removeprefix('torch.')} (shape {shape})"


def _compare(me: int, src: int, op: str, t: torch.Tensor, site, theirs: dict):
    """The error if ``theirs`` (the sender's header) does not fit ``t``; else None."""
    if theirs["numel"] == t.numel() and theirs["dtype"] == t.dtype:
        return None
    return PointToPointMismatchError(
        f"rank {me}'s {op} at {site_label(site)} expects {_what(t.numel(), t.dtype, list(t.shape))}"
        f" from rank {src}, whose send at {theirs['at']} sends "
        f"{_what(theirs['numel'], theirs['dtype'], theirs['shape'])}: sizes or dtypes differ, so "
        f"nothing was received (the data was set aside); every engine and its state are kept")


@contextlib.contextmanager
def _noted(note):
    """While the main thread waits on a checked ``isend`` / ``irecv``, the cell
    guard's note of the call (``state.current_collective``, ``note = (state,
    call)``) is back in place: the side door's ``where`` shows the rank inside
    that point-to-point call, so a wait for a peer that has finished the cell
    is a certain deadlock, released at once as a blocking ``recv``'s is --
    without the note, an ``irecv(...).wait()`` whose sender never sends read
    as Python code running, and the cell hung until its timeout (measured: 20 s
    with ``timeout=20``; a ``recv`` in its place, 0.45 s)."""
    if note is None or threading.get_ident() != threading.main_thread().ident:
        yield
        return
    state, call = note
    before, state.current_collective = state.current_collective, call
    try:
        yield
    finally:
        state.current_collective = before


class Sent:
    """What ``isend`` returns: the data's work; waiting also waits for its header."""

    def __init__(self, head, work, note=None):
        self._head, self._work, self._note = head, work, note

    def wait(self, timeout=None):
        with _noted(self._note):
            ok = self._work.wait() if timeout is None else self._work.wait(timeout)
            self._head.wait()
        return ok

    def __getattr__(self, name):  # is_completed, exception, ... as the data's work says
        return getattr(self._work, name)


class Received:
    """What ``irecv`` returns: done once a per-source thread has checked the header
    and posted the data's receive; ``wait`` raises the mismatch if there was one."""

    def __init__(self, note=None):
        self._ready = threading.Event()
        self._work = None
        self._note = note  # see _noted
        self.error: BaseException | None = None
        self.src = -1

    def wait(self, timeout=None):
        with _noted(self._note):
            self._ready.wait()
            if self.error is not None:
                err, self.error = self.error, None
                raise err
            return self._work.wait() if timeout is None else self._work.wait(timeout)

    def is_completed(self) -> bool:
        return self._ready.is_set() and (self.error is not None or self._work.is_completed())

    def _source_rank(self) -> int:
        return self.src

    source_rank = _source_rank

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        self._ready.wait()
        return getattr(self._work, name)


def send(pg, t: torch.Tensor, dst: int, tag: int, site, *, wait: bool, note=None):
    """``send`` (``wait``) or ``isend``: the header, then the data, neither waiting for
    the peer.  ``note``: the guard's record of the call, back in place while an
    ``isend``'s work is waited on (:func:`_noted`)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    head = pg.send([_header(t, site)], dst, tag | META_TAG_BIT)
    work = pg.send([t], dst, tag)
    if not wait:
        return Sent(head, work, note)
    work.wait()
    head.wait()
    return None


def _receive(pg, me: int, src, tag: int, t: torch.Tensor, site, op: str):
    """Header first (from ``src``, or any rank), then the data's receive posted:
    ``(work, src)``; on a mismatch the data is set aside and the error raised."""
    buf = torch.empty(META_BYTES, dtype=torch.uint8)
    if src is None:
        w = pg.recv_anysource([buf], tag | META_TAG_BIT)
        w.wait()
        src = source_rank(w)
    else:
        pg.recv([buf], src, tag | META_TAG_BIT).wait()
    theirs = _read(buf)
    err = _compare(me, src, op, t, site, theirs)
    if err is not None:
        spare = torch.empty(theirs["numel"], dtype=theirs["dtype"] or torch.uint8)
        pg.recv([spare], src, tag).wait()  # the sender's call completes; the streams stay in step
        raise err
    return pg.recv([t], src, tag), src


def recv(pg, me: int, t: torch.Tensor, src, tag: int, site) -> int:
    """``recv``: checked, then received; the sender's rank back (as torch returns it)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    work, src = _receive(pg, me, src, tag, t, site, "recv")
    work.wait()
    return src


class Poster:
    """One thread per source (``None``: any source) posting ``irecv``'s data
    receives in the order they were called -- the order gloo pairs them in.
    One per engine, held by the cell guard (:class:`dpnb.engine.cell.cellguard.Guard`)."""

    def __init__(self):
        self.queues: dict[Any, queue.SimpleQueue] = {}
        self.lock = threading.Lock()

    def submit(self, key, job) -> None:
        with self.lock:
            q = self.queues.get(key)
            if q is None:
                q = self.queues[key] = queue.SimpleQueue()
                threading.Thread(target=self._run, args=(q,), daemon=True,
                                 name=f"dpnb-irecv-{key}").start()
        q.put(job)

    @staticmethod
    def _run(q: queue.SimpleQueue) -> None:
        while True:
            job = q.get()
            job()


def irecv(pg, me: int, t: torch.Tensor, src, tag: int, site, poster: Poster,
          note=None) -> Received:
    """``irecv``: returns at once; the data's receive is posted once the header is in.
    ``note``: as for :func:`send`."""
    if t.is_complex():
        t = torch.view_as_real(t)
    out = Received(note)

    def job():
        try:
            out._work, out.src = _receive(pg, me, src, tag, t, site, "irecv")
        except BaseException as e:  # raised from the caller's wait()  # noqa: BLE001
            log.debug("irecv from %s: %s: %s", src, type(e).__name__, e)
            out.error = e
        out._ready.set()

    poster.submit(src, job)
    return out

"""One rank's trace, bounded: what each event is and where its collectives were entered.

``torch.profiler`` writes a Chrome trace per rank.  This module names its
events -- compute, communication (gloo's worker-thread spans on CPU; NCCL
kernels on a GPU, ``ncclDevKernel_AllReduce_Sum_f32_RING_LL`` in NCCL ≥ 2.19
and ``ncclKernel_AllReduce_RING_LL_Sum_float`` before: Holistic Trace
Analysis still looks only for the older name; a kernel is named by the c10d
call that launched it where the trace links them), and the enqueue on the
calling thread (``c10d::allreduce_``), which is where a rank *enters* a
collective on CPU -- and keeps of a rank's trace only what the analysis in
:mod:`dpnb.core.profile` needs, under caps, as a :class:`RankTrace`.

Pure Python: the engine calls :func:`extract` on its own trace; tests call
it on synthetic ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum
from typing import Iterable, Sequence


#: the marker each rank records beside its wall clock when profiling starts
CLOCK_MARKER = "dpnb:clock"
END_MARKER = "dpnb:end"
#: the span around a checked collective's check (dpnb.engine.cell.cellguard): the
#: rank entered the collective when the check began -- it waits there, on the
#: check's own connections, for the ranks that have not called it yet
CHECK_MARKER = "dpnb:check"
#: caps on what one rank sends back (a long cell can record millions of ops)
MAX_COMPUTE_INTERVALS = 20_000
MAX_COMM_EVENTS = 20_000
_DTYPE_BYTES = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8, "long int": 8,
                "int": 4, "unsigned char": 1, "signed char": 1, "bool": 1, "short int": 2,
                "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}
_NCCL_KERNEL = re.compile(r"^nccl(Dev)?Kernel_|^ncclDevFunc_|^ncclKernel")
_OPS = (("reducescatter", "reduce_scatter"), ("allgather", "all_gather"),
        ("allreduce", "all_reduce"), ("alltoall", "all_to_all"), ("broadcast", "broadcast"),
        ("barrier", "barrier"), ("sendrecv", "send_recv"), ("send", "send_recv"),
        ("recv", "send_recv"), ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"),
        ("coalesced", "coalesced"))
_PREFIXES = ("gloo:", "nccl:", "c10d::", "nccldevkernel_", "ncclkernel_", "nccldevfunc_")


class Kind(Enum):
    """What one trace event is, for the lanes."""

    COMPUTE = "compute"
    COMM = "comm"  # the collective itself (gloo worker span, NCCL kernel)
    ENQUEUE = "enqueue"  # the calling thread entering a collective (c10d::*)
    OTHER = "other"


def is_nccl_kernel(name: str) -> bool:
    """Every name NCCL's kernels have had: ``ncclDevKernel_*`` (2.19+), ``ncclKernel_*``."""
    return bool(_NCCL_KERNEL.match(name))


def op_of(name: str) -> str:
    """``all_reduce``, ``reduce_scatter``, ... from any of gloo's, NCCL's or c10d's names."""
    s = name.lower()
    for p in _PREFIXES:
        if s.startswith(p):
            s = s[len(p):]
            break
    key = re.sub(r"[^a-z]", "", s.split("_sum")[0] if "nccl" in name.lower() else s)
    for k, op in _OPS:
        if k in key:
            return op
    return "other"


def classify(name: str, cat: str) -> Kind:
    """The lane of one Chrome-trace event (``name``, ``cat`` as torch.profiler writes them)."""
    if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
        return Kind.COMM if is_nccl_kernel(name) else Kind.COMPUTE
    if name.startswith("gloo:"):
        return Kind.COMM
    if name.startswith("c10d::") or name == "record_param_comms":
        return Kind.ENQUEUE
    if cat == "cpu_op":
        return Kind.COMPUTE
    return Kind.OTHER


@dataclass(frozen=True)
class CommEvent:
    """One collective as a rank saw it, on its own trace clock (µs)."""

    op: str
    start_us: float
    end_us: float
    nbytes: int | None  # the tensor's bytes on this rank, when the trace says
    arrive_us: float  # when this rank entered it (its c10d enqueue; else start_us)
    name: str = ""


@dataclass(frozen=True)
class RankTrace:
    """What one rank sends back: bounded, on its own trace clock (µs)."""

    rank: int
    host: str
    device: str  # "cpu" or "cuda"
    wall_offset_us: float  # trace clock + this = wall clock (µs since the epoch)
    start_us: float
    end_us: float
    compute: tuple[tuple[float, float], ...]  # merged (start, end)
    comm: tuple[CommEvent, ...]
    steps: int = 0  # model forwards seen (DDP / FSDP), 0 when none
    dropped: int = 0  # events past the caps
    trace_file: str = ""
    trace_bytes: int = 0
    error: str = ""  # what went wrong on this rank while profiling ("" when nothing)
    # the wall clock was read inside the clock marker's span: its place on the
    # trace clock is known to within half that span (µs; long on a busy CPU)
    wall_err_us: float = 0.0


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals, sorted and disjoint."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def total(intervals: Sequence[tuple[float, float]]) -> float:
    """Summed length of disjoint intervals."""
    return sum(e - s for s, e in intervals)


def subtract(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of merged intervals ``a`` outside merged intervals ``b``."""
    out, j = [], 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def _nbytes(args: dict) -> int | None:
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not dims or not types:
        return None
    d, t = dims[0], types[0]
    if isinstance(d, list) and d and isinstance(d[0], list):  # a TensorList: its first tensor
        d = d[0]
    size = _DTYPE_BYTES.get(t)
    if size is None or not isinstance(d, list) or not all(isinstance(x, int) for x in d):
        return None
    n = 1
    for x in d:
        n *= x
    return n * size


def _call_op(e: dict) -> str:
    """The collective a CPU-side c10d event names ("" for any other event):
    ``record_param_comms`` by its ``Collective name``, ``nccl:all_reduce`` and
    ``c10d::allreduce_`` by theirs."""
    name = str(e.get("name", ""))
    if name == "record_param_comms":
        name = str((e.get("args") or {}).get("Collective name", ""))
    elif not name.startswith(("nccl:", "c10d::")):
        return ""
    op = op_of(name)
    return "" if op == "other" else op


def _launch_ops(spans: list[dict]) -> dict[int, str]:
    """``{id(kernel event): op}`` for the NCCL kernels a c10d call launched.

    A kernel's name says what NCCL ran, not what was asked: grouped and
    coalesced launches (FSDP2's, ``_coalescing_manager``'s) all run
    ``ncclDevKernel_Generic``, and one rank's kernel name can differ from
    another's for the same call.  The CPU side names the call: the kernel's
    ``External id`` is that of the op that launched it (``nccl:all_reduce``,
    ``record_param_comms``); failing that, its ``correlation`` leads to the
    runtime launch, and the innermost c10d event around that launch on its
    thread names it.  Kernels neither leads to keep their name's op."""
    by_ext: dict = {}  # External id -> op of a c10d event
    around: dict = {}  # thread -> [(start, end, op)] of c10d events
    launches: dict = {}  # correlation -> (thread, time) of the runtime launch
    for e in spans:
        args, cat = e.get("args") or {}, e.get("cat")
        if cat in ("cuda_runtime", "cuda_driver"):
            if args.get("correlation") is not None:
                launches[args["correlation"]] = (e.get("tid"), float(e["ts"]))
        elif cat != "kernel" and (op := _call_op(e)):
            if args.get("External id") is not None:
                by_ext[args["External id"]] = op
            s = float(e["ts"])
            around.setdefault(e.get("tid"), []).append((s, s + float(e["dur"]), op))
    out = {}
    for e in spans:
        if e.get("cat") != "kernel" or not is_nccl_kernel(str(e.get("name", ""))):
            continue
        args = e.get("args") or {}
        op = by_ext.get(args.get("External id"))
        if op is None and args.get("correlation") in launches:
            tid, at = launches[args["correlation"]]
            inner = [(s, o) for s, t, o in around.get(tid, ()) if s <= at <= t]
            op = max(inner)[1] if inner else None
        if op:
            out[id(e)] = op
    return out


def _pair(comm_raw: list, enq: list[tuple[float, str]], on_device: bool) -> list[CommEvent]:
    """Each collective's span with the call that entered it.

    On CPU, gloo runs the calls in the order they were made, so when the
    counts agree the k-th call is the k-th span, and the call names the op
    the user asked for (gloo runs FSDP's reduce-scatter as an all-reduce).
    Otherwise the k-th call of an op is the k-th span of that op; where
    even those counts differ the entry is not known and the span's start
    stands in.  A GPU kernel starts when its stream reaches it and waits for
    the peers inside, so its start is the entry, not the CPU's launch.
    """
    out = []
    if not on_device and enq and len(enq) == len(comm_raw):
        for (e, s, t, _), (at, op) in zip(comm_raw, enq):
            out.append(CommEvent(op, s, t, _nbytes(e.get("args", {})), min(at, s), str(e["name"])))
        return out
    ops = [op for _, _, _, op in comm_raw]
    by_op: dict[str, list[float]] = {}
    for at, op in enq:
        by_op.setdefault(op, []).append(at)
    seen: dict[str, int] = {}
    for (e, s, t, _), op in zip(comm_raw, ops):
        k = seen.get(op, 0)
        seen[op] = k + 1
        calls = by_op.get(op, [])
        known = not on_device and len(calls) == ops.count(op)
        out.append(CommEvent(op, s, t, _nbytes(e.get("args", {})), min(calls[k], s) if known else s,
                             str(e["name"])))
    return out


def _entered_at_checks(enq: list[tuple[float, str]],
                       checks: list[tuple[float, float]]) -> list[tuple[float, str]]:
    """Each c10d call's entry, moved back to the start of the check that just
    preceded it (the check ended before the call, after the previous call).

    In a checked cell the waiting for a late rank happens in the check, so the
    c10d calls of every rank start together, after the last one arrived: read
    from them, the rank that waited looked late and the late one on time.
    """
    out, j, prev = [], 0, float("-inf")
    for at, op in enq:
        found = None
        while j < len(checks) and checks[j][1] <= at:
            if checks[j][0] >= prev:
                found = checks[j][0]
            j += 1
        out.append((found if found is not None else at, op))
        prev = at
    return out


def extract(events: list[dict], *, rank: int, host: str, wall_offset_us: float = 0.0,
            trace_file: str = "", trace_bytes: int = 0, error: str = "") -> RankTrace:
    """Bound one rank's Chrome-trace events to a :class:`RankTrace`.

    Device traces (any kernel event): compute and communication are the
    GPU's kernels.  CPU traces: communication is gloo's worker-thread spans,
    compute the ops of every other thread (``c10d::`` enqueues excluded: the
    wait behind them is communication, not work).  The window runs from
    the :data:`CLOCK_MARKER` (or the first event) to the :data:`END_MARKER`
    (or the last event).  ``wall_offset_us``: this trace's clock to the wall
    clock (see :func:`wall_offset`).
    """
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    clock = [e for e in spans if e.get("name") == CLOCK_MARKER]
    end = [e for e in spans if e.get("name") == END_MARKER]
    on_device = any(e.get("cat") == "kernel" for e in spans)
    kinds = [(e, classify(str(e.get("name", "")), str(e.get("cat", "")))) for e in spans]
    comm_threads = {e.get("tid") for e, k in kinds if k is Kind.COMM and e.get("cat") != "kernel"}
    launched = _launch_ops(spans) if on_device else {}  # NCCL kernels named by their call
    compute: dict = {}  # thread (or "gpu") -> its ops' spans
    inside: dict = {}  # thread -> its spans inside a c10d call
    comm_raw: list = []
    enq: list[tuple[float, str]] = []  # (start, op) of each c10d call
    checks: list[tuple[float, float]] = []  # (start, end) of each collective's check
    for e, k in kinds:
        s, d = float(e["ts"]), float(e["dur"])
        cat = e.get("cat")
        if str(e.get("name", "")).startswith(CHECK_MARKER):
            checks.append((s, s + d))  # waiting for the peers: never compute
        elif k is Kind.COMM and (cat == "kernel") == on_device:
            comm_raw.append((e, s, s + d, launched.get(id(e)) or op_of(str(e["name"]))))
        elif k is Kind.ENQUEUE:
            if e.get("name") != "record_param_comms":
                enq.append((s, op_of(e["name"])))
            inside.setdefault(e.get("tid"), []).append((s, s + d))
        elif k is Kind.COMPUTE:
            if on_device and cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
                continue  # on a GPU the CPU side only launches work
            if not on_device and e.get("tid") in comm_threads:
                continue
            compute.setdefault(e.get("tid") if not on_device else "gpu", []).append((s, s + d))
    entered = _entered_at_checks(sorted(enq), sorted(checks)) if checks else sorted(enq)
    comm = _pair(sorted(comm_raw, key=lambda x: x[1]), entered, on_device)
    if checks:  # from its check on, a rank is in the collective: its wait is communication
        at_check = {a for a, _ in entered} & {c[0] for c in checks}
        comm = [replace(c, start_us=c.arrive_us) if c.arrive_us in at_check else c for c in comm]
    # time a thread spends inside a c10d call is waiting for communication,
    # even where a parent op (autograd's AccumulateGrad hook) spans it
    merged = merge(iv for tid, ivs in compute.items()
                   for iv in subtract(merge(ivs), merge(inside.get(tid, ()))))
    dropped = max(0, len(merged) - MAX_COMPUTE_INTERVALS) + max(0, len(comm) - MAX_COMM_EVENTS)
    starts = [float(e["ts"]) for e in spans]
    ends = [float(e["ts"]) + float(e["dur"]) for e in spans]
    start = float(clock[0]["ts"]) if clock else min(starts, default=0.0)
    stop = float(end[0]["ts"]) if end else max(ends, default=start)
    steps = sum(1 for e in spans if e.get("name") in ("DistributedDataParallel.forward",)
                or str(e.get("name", "")).startswith("FSDP::root_pre_forward"))
    return RankTrace(rank, host, "cuda" if on_device else "cpu", wall_offset_us, start, stop,
                     tuple(merged[:MAX_COMPUTE_INTERVALS]), tuple(comm[:MAX_COMM_EVENTS]), steps,
                     dropped, trace_file, trace_bytes, error,
                     float(clock[0].get("dur", 0.0)) / 2 if clock else 0.0)


def wall_offset(events: list[dict], wall_us: float) -> float:
    """Trace clock to wall clock: ``wall_us`` was read inside the :data:`CLOCK_MARKER` span."""
    for e in events:
        if e.get("name") == CLOCK_MARKER and "ts" in e:
            return wall_us - (float(e["ts"]) + float(e.get("dur", 0.0)) / 2)
    return 0.0

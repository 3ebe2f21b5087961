"""A real multi-process gloo group for engine tests, without ipyparallel.

``run_ranks(fn, *args)`` starts ``world_size`` Python processes (forks of a
forkserver that imported torch once: :func:`_context`), forms
a default gloo process group among them over ``tcp://127.0.0.1:<free port>``,
builds in each one the engine namespace that dpnb's cluster start builds on an
engine (``_dpnb`` EngineState, ``rank``, ``world_size``, ``device``, ``torch``,
``dist``), and calls ``fn(ns, *args, **kwargs)`` there.  It returns the list
of per-rank return values (rank order).  An exception on any rank fails the
test with every rank's traceback.

``fn`` must be a module-level function of a test module (or of this module):
the children load that module from its file by path, so nothing depends on
pytest's import mode and no closure is ever pickled -- the same discipline the
engines follow.

``reform(ns, port)`` plays the part of the lead's recovery code: it destroys
the default group, forms a new one on ``port``, bumps the generation and runs
the ``on_reform`` callbacks.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import queue as _queue
import socket
import sys
import time
import traceback
from datetime import timedelta

import multiprocessing as _mp

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TIMEOUT_S = 20


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_ns(rank: int, world_size: int, port: int, backend: str = "gloo") -> dict:
    """The namespace an engine holds after dpnb's cluster start (CPU/gloo; with
    ``backend="nccl"``, the stand-in's: every rank on ``cuda:0``, see
    :mod:`helpers.standin`)."""
    import torch
    import torch.distributed as dist

    from dpnb.engine.state import STATE_NAME, EngineState

    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    state = EngineState(
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        local_world_size=world_size,
        node_rank=0,
        backend=backend,
        device=device,
        master_addr="127.0.0.1",
        master_port=port,
        timeout_s=TIMEOUT_S,
    )
    return {
        STATE_NAME: state,
        "rank": rank,
        "world_size": world_size,
        "local_rank": rank,
        "device": device,
        "torch": torch,
        "dist": dist,
    }


def init_group(rank: int, world_size: int, port: int, backend: str = "gloo") -> None:
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=TIMEOUT_S),
    )


def reform(ns: dict, port: int | None = None) -> None:
    """Destroy the default group and form a new one, as the lead's recovery
    code does, then run the registered callbacks.

    The new port is chosen now by rank 0 and passed through the old group's
    store: a port picked long before could meanwhile be taken (e.g. as the
    local end of one of gloo's own connections).  Rank 0 tears its end down
    only once every rank has read it, so no message of the old group is in
    flight when it goes (the port sent by a broadcast once ended in gloo's
    "Connection reset by peer" in a full run).  ``port`` is ignored but kept
    for callers that still pass one.
    """
    import torch.distributed as dist

    state = ns["_dpnb"]
    store = dist.distributed_c10d._get_default_store()
    key = f"test-reform/{state.generation}"
    if state.rank == 0:
        store.set(key + "/port", str(free_port()))
    port = int(store.get(key + "/port"))
    read = store.add(key + "/read", 1)
    deadline = time.monotonic() + TIMEOUT_S
    while state.rank == 0 and read < state.world_size:  # the store lives in rank 0
        if time.monotonic() > deadline:
            raise TimeoutError(f"reform: {state.world_size - read} ranks never read the new port")
        time.sleep(0.01)
        read = store.add(key + "/read", 0)
    dist.destroy_process_group()
    init_group(state.rank, state.world_size, port, state.backend)
    state.master_port = port
    state.generation += 1
    for cb in list(state.on_reform):
        cb(ns, state)


def _load(path: str, name: str):
    modname = "_dpnb_test_" + os.path.splitext(os.path.basename(path))[0]
    mod = sys.modules.get(modname)
    if mod is None:
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        spec.loader.exec_module(mod)
    return getattr(mod, name)


def _child(rank, world_size, port, path, name, args, kwargs, q):
    if REPO not in sys.path:  # the checkout's dpnb, whatever the child's working directory
        sys.path.insert(0, REPO)
    import faulthandler

    # a rank that hangs past the harness's patience shows where, in the log
    faulthandler.dump_traceback_later(kwargs.pop("_hang_dump_s", 200), exit=False)
    standin = kwargs.pop("_standin", False)
    try:
        import contextlib

        import torch

        torch.set_num_threads(1)
        torch.set_num_interop_threads(1)
        mode = contextlib.nullcontext()
        if standin:  # NCCL's stand-in (tests/helpers/standin.py), loaded by path as fn is
            mod = _load(os.path.join(HERE, "standin.py"), "install").__module__
            sys.modules[mod].install()
            mode = sys.modules[mod].CudaMode()
        backend = "nccl" if standin else "gloo"
        init_group(rank, world_size, port, backend)
        ns = make_ns(rank, world_size, port, backend)
        fn = _load(path, name)
        with mode:
            out = fn(ns, *args, **kwargs)
        q.put(("ok", rank, pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt
        q.put(("err", rank, traceback.format_exc()))
    # Send the report, then leave without tearing the namespace down.  Freeing
    # a DDP whose Reducer holds the last reference to a gloo group joins the
    # group's worker threads with the GIL held (the Reducer's binding does not
    # release it), while a worker still freeing its last work's tensors waits
    # for the GIL: both ranks hang for good (torch issue #56297; seen here as
    # "ranks [0] did not report", the queue's feeder thread being stuck behind
    # the same GIL with the report unsent).  Nothing a test checks happens in
    # that teardown.
    q.close()
    q.join_thread()  # waits with the GIL released: the report is on the pipe
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


#: imported once by the forkserver the ranks are forked from: never dpnb nor a
#: test module (a break changes their files; each child loads them afresh)
PRELOAD = ("torch", "torch.distributed", "numpy")


def _context():
    """A forkserver that imported torch once: each rank is a fork of it, not a
    fresh interpreter importing torch again (3.4 CPU-s a rank here, most of an
    engine test's time on 2 cores).  The server is a clean single-threaded
    process started at the first call, so a fork of it holds none of pytest's
    state, threads or open groups; it takes the environment of that moment,
    which is why no test that runs ranks sets one (``DPNB_TEST_MP=spawn``: a
    fresh interpreter per rank, as before)."""
    if os.environ.get("DPNB_TEST_MP") == "spawn":
        return _mp.get_context("spawn")
    ctx = _mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    _mp_folder_beside_the_workers()
    return ctx


def _mp_folder_beside_the_workers() -> None:
    """multiprocessing keeps the forkserver's socket in a folder of its own, removed
    at exit -- after pytest removed an xdist worker's temporary folder
    (tests/conftest.py), which printed a FileNotFoundError at every worker's exit.
    Made beside that folder instead (the folder is made once per process)."""
    import tempfile
    from multiprocessing import util

    saved = tempfile.gettempdir()
    if os.path.basename(saved).startswith("dpnb-tests-"):
        tempfile.tempdir = os.path.dirname(saved)
        try:
            util.get_temp_dir()
        finally:
            tempfile.tempdir = saved


def run_ranks(fn, *args, world_size: int = 2, timeout: float = 120, standin: bool = False,
              **kwargs):
    """Run ``fn(ns, *args, **kwargs)`` on ``world_size`` gloo ranks (``standin``:
    on NCCL's CPU stand-in, inside its :class:`helpers.standin.CudaMode`)."""
    kwargs = {**kwargs, "_hang_dump_s": max(10.0, timeout - 15.0), "_standin": standin}
    path = os.path.abspath(sys.modules[fn.__module__].__file__)
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, port, path, fn.__name__, args, kwargs, q),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            # Once one rank failed, the others are usually stuck in a
            # collective: give them a moment to report, then stop waiting.
            left = deadline - time.monotonic()
            if errors:
                left = min(left, 3.0)
            if left <= 0:
                break
            try:
                kind, rank, payload = q.get(timeout=min(left, 0.5))
            except _queue.Empty:
                # A child that died before reporting (e.g. at start-up) will
                # never report: stop waiting for it.
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in results and r not in errors]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode} without reporting"
                continue
            if kind == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors or len(results) < world_size:
        missing = [r for r in range(world_size) if r not in results and r not in errors]
        msg = [f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())]
        if missing:
            msg.append(f"ranks {missing} did not report within {timeout}s")
        raise AssertionError("\n".join(msg))
    return [results[r] for r in range(world_size)]

"""The engine process itself: it ends with its kernel, stops fast on SIGTERM,
shows figures inline, and keeps Python's garbage collector out of the
training loop's way.  Set up once by :func:`dpnb.engine.setup.init_rank`."""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.util
import inspect
import logging
import os
import resource
import signal
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: during ``train`` Python's cyclic garbage collector runs at these steps only,
#: on every rank at once, and only over its young generations
GC_EVERY = 50


def watch_parent(ppid: int, period: float = 1.0) -> None:
    """Exit when the notebook kernel that started this engine is gone.

    A kernel killed with SIGKILL runs no atexit handler, so ipyparallel cannot
    stop its engines; without this they would hold CPUs/GPUs forever.
    """

    def loop() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != ppid:
                os._exit(3)

    threading.Thread(target=loop, name="dpnb-parent-watch", daemon=True).start()


def exit_fast_on_sigterm() -> None:
    """SIGTERM (every stop: ``%dp stop``, ipyparallel's, the host agent's,
    the reaper's) ends this engine at once.

    ipyparallel's own handler stops the kernel's loop and lets Python wind
    down: with torch imported and a gloo group that took 1.2-1.7 s per engine
    here, and a cell still running delayed it until ipyparallel's SIGKILL.
    The user's ``atexit`` hooks (a logger's flush) still run; the interpreter's
    module teardown, which a process about to vanish does not need, does not.
    Main thread only (``signal.signal``); ``init_rank`` runs there.
    """

    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum, frame):
        try:
            atexit._run_exitfuncs()
        except BaseException as e:  # dying anyway: say why a hook failed, then go
            log.warning("atexit hook failed during stop: %s: %s", type(e).__name__, e)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or redirected stream: nothing left to save
                pass
        # die of the signal itself, so a death report (Slurm's time limit, a
        # kill by hand) still says "killed by signal 15 (SIGTERM)"
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        os._exit(128 + signal.SIGTERM)  # not reached: the default action ends the process

    signal.signal(signal.SIGTERM, stop)


#: open files a rank needs per rank of its group, with room: rank 0 holds a
#: connection per rank to its store, to its check star and a gloo pair to every
#: peer (3 N), every rank the N - 1 pairs (docs/scale.md)
FDS_PER_RANK = 4
FDS_BASE = 256


def raise_fd_limit(world: int) -> int:
    """Raise this process's soft limit on open files to what a group of
    ``world`` ranks needs (at most the hard limit); the soft limit now.

    A common default soft limit is 1,024, which rank 0 passes at about 300
    ranks; torchrun leaves it to the job, a notebook user cannot."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FDS_PER_RANK * world + FDS_BASE
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if new < want:
        log.warning("open-file limit %s (hard) is below the %s a group of %s ranks needs",
                    hard, want, world)
    if new > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return max(new, soft)


def freeze_startup_heap() -> int:
    """Move everything the engine holds before any user code runs (torch,
    IPython, ipyparallel, dpnb: ~325,000 objects here) out of the cyclic
    collector's reach; returns how many.

    Those objects live as long as the process, yet every full collection
    walked them all: 146-226 ms for one full ``gc.collect()`` in an idle
    engine here, 0.0 ms after this.  A full collection comes whenever code
    calls ``gc.collect()`` (Accelerate's ``free_memory``, evaluation loops,
    users) and once the objects that outlived younger collections pass a
    quarter of the old generation; on one rank it stalls every other rank at
    the next collective.  What user code creates later is collected as before
    (CPython documents ``gc.freeze`` for this: after start-up, before the
    work)."""
    gc.freeze()
    return gc.get_freeze_count()


def setup_inline_figures() -> None:
    """Make matplotlib figures made in ``%%dp`` cells come back as images.

    Naming the inline backend in ``MPLBACKEND`` is enough: when a cell
    first imports pyplot, matplotlib-inline hooks itself into the engine's
    IPython.  Importing matplotlib here instead would add about a second to
    every ``%dp start`` for clusters that never plot.
    """

    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    if "matplotlib" not in sys.modules:
        return
    try:  # already imported (a restart keeps the process): switch it now
        # lazy: boot imports this module before the kernel (and IPython) exists
        from IPython import get_ipython

        get_ipython().run_line_magic("matplotlib", "inline")
    except Exception as e:  # matplotlib is optional for plain training cells
        log.info("inline figures not switched on: %s: %s", type(e).__name__, e)


#: the key, in a display's ``transient``, that marks an engine's
#: ``update_display_data`` sent as a ``display_data`` (read by
#: :mod:`dpnb.cluster.render`)
DISPLAY_UPDATE = "dpnb_update"


def forward_display_updates() -> None:
    """Let the notebook see this engine's display updates (once per process).

    ``display(obj, display_id=True)`` then ``handle.update(obj)`` -- how
    Hugging Face's ``NotebookProgressCallback`` redraws its table -- sends
    ``update_display_data``, which ipyparallel's client drops: only the
    first drawing reached the notebook (the table froze at "[2/5 :").
    Here an update goes out as a ``display_data`` whose ``transient`` (never
    saved with a notebook) carries :data:`DISPLAY_UPDATE`; ipyparallel keeps
    it with the cell's outputs, and the notebook applies it to the display
    with the same ``display_id``.  Nothing changes for other displays.
    """
    try:
        # lazy: boot imports this module before the kernel (and IPython) exists
        from IPython import get_ipython

        pub = get_ipython().display_pub
    except Exception as e:  # not inside an engine's kernel (a test, a plain process)
        log.info("display updates not forwarded: %s: %s", type(e).__name__, e)
        return
    publish = pub.publish
    if getattr(publish, "dpnb_forwards_updates", False):
        return

    def forwarding(data, metadata=None, *args, transient=None, update=False, **kwargs):
        if update:
            transient = {**(transient or {}), DISPLAY_UPDATE: True}
        return publish(data, metadata, *args, transient=transient, **kwargs)

    forwarding.dpnb_forwards_updates = True
    pub.publish = forwarding


class _TextTqdm:
    """Import hook: ``tqdm.autonotebook`` (and so ``tqdm.auto``) gives the text bar.

    In a terminal the notebook cannot show an engine's widgets; tqdm would
    still pick its widget bar, because an engine is a kernel.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "tqdm.autonotebook":
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        # lazy: tqdm loads only when a cell imports tqdm.auto
        from tqdm.std import tqdm, trange

        module.tqdm, module.trange = tqdm, trange
        module.__all__ = ["tqdm", "trange"]


def keep_queued_cells_after_an_error(kernel: Any) -> bool:
    """A cell that fails must not cancel the cells sent after it.

    ipykernel aborts every execute request queued behind one that failed
    unless the request says ``stop_on_error: False`` -- ipyparallel's do not.
    In a notebook the next cell comes seconds later; a script, an agent or a
    test sends it at once: seen in a full test run, the cell after a released
    point-to-point failure came back "rank 2 raised TaskAborted".  The notebook
    already decides what runs next (a failed cell stops nothing on its own), so
    each request here defaults to not aborting the queue.  Once per process."""
    handlers = getattr(kernel, "shell_handlers", None)
    run = handlers.get("execute_request") if isinstance(handlers, dict) else None
    if run is None or getattr(run, "__dpnb_keeps_queue__", False):
        return False

    async def execute_request(stream, ident, parent):
        content = parent.get("content")
        if isinstance(content, dict):
            content.setdefault("stop_on_error", False)
        out = run(stream, ident, parent)
        return (await out) if inspect.isawaitable(out) else out

    execute_request.__dpnb_keeps_queue__ = True  # type: ignore[attr-defined]
    handlers["execute_request"] = execute_request
    return True


def every_request_is_answered(kernel: Any) -> None:
    """The kernel's two habits that cost a cell its reply, mended (once per process):
    :func:`keep_queued_cells_after_an_error` and :func:`interrupts_reach_only_the_code`."""
    keep_queued_cells_after_an_error(kernel)
    interrupts_reach_only_the_code(kernel)


def in_the_code(frame, cell_code, apply_code) -> bool:
    """True when ``frame`` (where the main thread is) is inside a request's code: a
    cell's statements (IPython's ``run_ast_nodes``, which turns a KeyboardInterrupt
    into the cell's error, between statements too) or the function an ``apply``
    runs (the ``exec`` right under ipyparallel's ``do_apply``).  Not the kernel's
    own work before or after it: building and sending the reply."""
    child = None
    while frame is not None:
        if frame.f_code is cell_code:
            return True
        if frame.f_code is apply_code:
            return child is not None and child.f_code.co_filename == "<string>"
        child, frame = frame, frame.f_back
    return False


def interrupts_reach_only_the_code(kernel: Any) -> bool:
    """A SIGINT that comes after a request's code has ended must not cost its reply.

    ipykernel raises KeyboardInterrupt wherever a SIGINT lands while it handles a
    request, and one that lands after the code -- while the reply is built and
    sent -- is caught as "KeyboardInterrupt caught in kernel" with no reply sent:
    the engine is idle, the controller counts the request as running for good,
    and every later cell is refused ("rank 3 still running an earlier cell").
    dpnb interrupts ranks that are still running when a peer failed; measured
    here, one of them had just left a released point-to-point wait and was
    sending its reply (1 in ~40 tries; more with a busy CPU).  So while a
    request is handled, SIGINT raises KeyboardInterrupt only inside its code
    (:func:`in_the_code`); elsewhere it is logged and dropped -- the code it
    was meant to stop has already ended."""
    if getattr(kernel, "__dpnb_sigint__", False) or getattr(kernel, "shell", None) is None:
        return False
    cell_code = type(kernel.shell).run_ast_nodes.__code__
    apply = getattr(type(kernel), "do_apply", None)
    apply_code = getattr(apply, "__code__", None)

    def on_sigint(signum, frame):
        if in_the_code(frame, cell_code, apply_code):
            raise KeyboardInterrupt
        log.info("SIGINT after the code of the request it was meant for had ended: dropped, "
                 "so the request's reply still reaches the notebook")

    def pre_handler_hook():  # ipykernel's sets default_int_handler; post_handler_hook restores
        kernel.saved_sigint_handler = signal.signal(signal.SIGINT, on_sigint)

    kernel.pre_handler_hook = pre_handler_hook
    kernel.__dpnb_sigint__ = True
    return True


def text_progress_bars() -> None:
    """Make ``tqdm.auto`` bars text bars on this engine (once)."""

    if not any(isinstance(f, _TextTqdm) for f in sys.meta_path):
        sys.meta_path.insert(0, _TextTqdm())


@contextlib.contextmanager
def scheduled_gc():
    """Python's automatic collector off for the call (restored after, also on
    an error); :meth:`dpnb.engine.train.step._Loop.one_step` collects the young
    generations every ``GC_EVERY`` steps.

    Why: an engine's heap holds torch, IPython and ipyparallel, and a full
    collection of it took about 200 ms here -- one every few hundred steps, set
    off by the objects a step leaves behind (its record), at a different step
    on each rank.  Every other rank waits for it in the next gradient sync, so
    at N ranks each rank's pauses stall all of them.  Collecting the young
    generations at the same step everywhere is what large training loops do
    (OLMo-core's and Megatron's garbage-collection callbacks); the full
    collection comes back with the collector after the call."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()

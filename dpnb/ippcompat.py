"""Every private internal of ipyparallel and ipykernel that dpnb touches, in one place.

The notebook talks to the engines through ipyparallel's client: a cell sent to
N ranks is one request per engine, each answered by a reply on the controller's
socket while the engine's output travels apart, on IOPub.  dpnb reads a few
things ipyparallel keeps privately (a reply's raw content, the raw output
metadata, the per-engine message futures) to wait for exactly a cell's output
and to skip work it does not need.  An ipyparallel upgrade that renames one
breaks one function here, and ``tests/unit/test_compat.py`` checks each against
the installed version (:func:`check_ipyparallel`).  torch's internals are in
:mod:`dpnb.compat`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger(__name__)


class RankReply:
    """One engine's answer to a request sent to several engines at once.

    ``DirectView.execute`` to N engines returns one ``AsyncResult`` holding a
    message future per engine; the transport needs each rank's answer on its
    own (a rank that failed must be seen while its peers still block).
    ``AsyncResult.split()`` builds a whole ``AsyncResult`` per engine for that:
    three events, three combined futures and their callbacks, which the
    client's IO thread runs again for every reply.  py-spy of the notebook at
    N = 8 (150 ``print`` cells) put 16 % of its main thread's GIL time in
    ``split``, while the next engine's request waited to be sent (issue 45).
    This handle reads the engine's message future directly: its reply
    (``future.result()``, an exception object when the cell failed, as
    ipyparallel stores it), its output metadata (``future.output.metadata``,
    filled by the IO thread as stdout, displays and the result arrive) and
    the output future the engine's "idle" status resolves.
    """

    __slots__ = ("_f",)

    def __init__(self, future: Any):
        self._f = future

    def ready(self) -> bool:
        return self._f.done()

    def wait(self, timeout: float | None) -> bool:
        return self._f.wait(timeout)

    def get(self, timeout: float | None = None):
        """The reply (an ``ExecuteReply``), or raise the engine's error as
        ``AsyncResult.get`` does."""
        if not self._f.wait(timeout):
            # lazy: `import dpnb` stays free of ipyparallel
            from ipyparallel.error import TimeoutError as ResultTimeout

            raise ResultTimeout("Result not ready.")
        r = self._f.result()
        if isinstance(r, Exception):
            raise r
        return r

    def wait_for_output(self, timeout: float | None) -> bool:
        """True once the engine's "idle" status (sent after all its output) came."""
        return self._f.output.wait(timeout)

    @property
    def metadata(self) -> dict:
        return self._f.output.metadata

    @property
    def reply(self) -> Any:
        return self._f.result() if self._f.done() else None


def rank_replies(ar: Any) -> list[RankReply]:
    """One :class:`RankReply` per engine of a multi-engine ``AsyncResult``, in
    the order its engines were given."""
    return [RankReply(f) for f in ar._children]


def result_metadata(ar: Any) -> dict:
    """The raw metadata dict of a single-engine ``AsyncResult`` or a :class:`RankReply`.

    ``ar.metadata`` parses every timestamp in it with dateutil first (about a
    millisecond per cell) although dpnb reads only the streams, so the raw
    ``_metadata`` list is read when it exists.
    """
    if isinstance(ar, RankReply):
        return ar.metadata
    raw = getattr(ar, "_metadata", None)
    md = raw[0] if isinstance(raw, list) and raw else None
    if md is None:
        md = ar.metadata
        md = md[0] if isinstance(md, list) else md
    return md if isinstance(md, dict) else {}


def reply_content(ar: Any) -> dict:
    """The content of a finished ``execute_reply`` (ipyparallel keeps it on its
    ``ExecuteReply``, for an ``AsyncResult`` in its ``_raw_results``); ``{}``
    for an error, an ``apply`` call, or a reply not in yet."""
    if isinstance(ar, RankReply):
        reply = ar.reply
    else:
        reply = (getattr(ar, "_raw_results", None) or [None])[0]
    content = getattr(reply, "_content", None)
    return content if isinstance(content, dict) else {}


def output_wait(ar: Any) -> Callable[[float | None], bool]:
    """``wait(timeout) -> bool`` for the engine's "idle" status of a
    single-engine ``AsyncResult`` or a :class:`RankReply`, without the
    ``AsyncResult.wait_for_output`` bookkeeping (polled every few ms)."""
    if isinstance(ar, RankReply):
        return ar.wait_for_output
    return ar._output_event.wait


def drop_input_echo(kernel: Any) -> bool:
    """Stop an engine's kernel echoing each cell's source on IOPub.

    ipykernel publishes ``execute_input`` (the cell's code) for frontends that
    show what runs; ipyparallel's client keeps it and dpnb never reads it.
    At N ranks it was N copies of the cell's source through the controller
    and the notebook's IO thread, for every cell."""
    if not callable(getattr(kernel, "_publish_execute_input", None)):
        log.warning("ipykernel has no _publish_execute_input: cells' source is echoed back")
        return False
    kernel._publish_execute_input = lambda *args, **kwargs: None
    return True


def shell_ignores_engine_comms() -> None:
    """Let a shell that is no Jupyter kernel ignore widget messages from engines.

    ipyparallel's client proxies ``comm_*`` messages from engines (an
    engine-side ipywidgets or ``tqdm.auto`` bar) when ``get_ipython().kernel
    is not None`` -- reading ``.kernel``, which only kernel shells have: in
    terminal IPython the read raised in the client's event loop and every
    later cell's output was lost.  ``kernel = None`` is what the check means
    by "no kernel here".
    """
    try:
        # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
        from IPython import get_ipython
    except ImportError:  # no IPython, no shell to mend
        return
    ip = get_ipython()
    if ip is not None and not hasattr(ip, "kernel"):
        ip.kernel = None


def check_ipyparallel() -> list[str]:
    """Problems with the ipyparallel internals dpnb reads (empty: all present)."""
    # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
    from ipyparallel.client.asyncresult import AsyncResult
    from ipyparallel.client.client import Client
    from ipyparallel.client.futures import MessageFuture

    probs = []
    if "_metadata" not in AsyncResult.__init__.__code__.co_names:
        probs.append("ipyparallel AsyncResult no longer keeps _metadata: result_metadata falls "
                     "back to the slower .metadata")
    if "_output_event" not in AsyncResult.__init__.__code__.co_names:
        probs.append("ipyparallel AsyncResult no longer has _output_event: output_wait fails")
    if "_children" not in AsyncResult.__init__.__code__.co_names:
        probs.append("ipyparallel AsyncResult no longer keeps _children: rank_replies fails")
    made = Client.create_message_futures.__code__.co_names
    if not ("output" in made and "metadata" in made and callable(getattr(MessageFuture, "wait"))):
        probs.append("ipyparallel's message futures no longer carry .output.metadata: "
                     "RankReply cannot read a rank's output")
    # lazy: as above
    from ipykernel.kernelbase import Kernel

    if not callable(getattr(Kernel, "_publish_execute_input", None)):
        probs.append("ipykernel's Kernel has no _publish_execute_input: cells' source is echoed")
    if "_raw_results" not in AsyncResult._resolve_result.__code__.co_names:
        probs.append("ipyparallel AsyncResult no longer keeps _raw_results: a cell's reply "
                     "counts are not read, the notebook waits for each engine's idle")
    return probs

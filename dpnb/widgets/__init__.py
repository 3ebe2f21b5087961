"""dpnb.widgets: the views behind ``%dp <view>``.

README
======

Every view renders only: the numbers come from :mod:`dpnb.core` and from the
engines' records.  Each module has the same layers:

* ``data(...)``   → a frozen dataclass of what is shown (bars, segments, rows);
* ``figure(data)`` → a pyplot-free :class:`matplotlib.figure.Figure` (~9.5 in
  wide, 100 dpi, Agg);
* ``text(data)`` / ``html(data)`` → terminal summary / HTML readouts + tables;
* ``view(cluster=None, ...)`` → an ipywidgets widget (a ``ViewBox``: ``.controls``
  by name, ``.data``, ``.figure``, ``.refresh()``, ``.text()``);
* ``show(cluster=None, ...)`` → in a kernel, displays the widget plus a static
  HTML/PNG copy that the controls keep updated (so saved notebooks and
  nbconvert/HTML keep the figure); in a terminal, prints ``text``;
* ``save(path, cluster=None, ...)`` → writes ``.png`` or ``.svg``.

Errors are :class:`ViewError` (a ValueError) or :class:`dpnb.core.ConfigError`,
whose messages say what to do.

Magics to wire (``%dp <view>`` → function, arguments → keyword)
--------------------------------------------------------------

``%dp gradsync [--step S] [--last K] [--cap-mb MB] [--link NAME] [--watch] [--save PATH]``
    ``gradsync.show(cluster, last=K, step=S, cap_mb=MB, link=NAME)``.
    ``--watch``: ``gradsync.watch(cluster)`` only (installs forward / optimizer /
    FSDP-collective timing hooks on every rank, no communication), then return.
    The lead's ``%dp wrap`` should call ``gradsync.watch(cluster)`` right after
    wrapping, so every trained step has the optimizer step and, under FSDP, the
    all-gather / reduce-scatter events (DDP buckets are recorded without it).
    ``--save PATH``: ``gradsync.save(PATH, cluster, last=K, step=S, cap_mb=MB)``.

``%dp batch [--micro-batch B] [--dp N] [--grad-accum K] [--seq-len L] [--target-tokens T] [--ref-lr LR] [--ref-batch RB] [--tp TP] [--pp PP] [--gpus G] [--live] [--save PATH]``
    ``batch.show(cluster if --live else None, micro_batch=B, dp=N, grad_accum=K,
    seq_len=L, target_tokens=T, ref_lr=LR, ref_batch=RB, tp=TP, pp=PP, gpus=G)``.
    Defaults: 4, 8, 1, 4096, 4·2**20, 3e-4, 256, 1, 1, 0 (= DP×TP×PP).  ``--live``
    fills DP from the cluster and micro-batch / grad-accum / seq-len from the last
    ``%dp train`` (rank 0's last step record).

``%dp memory [--params P] [--dp N] [--precision fp32|bf16-mixed|fp16-mixed] [--optimizer adam|adamw|sgd-momentum|sgd] [--capacity-gb GB] [--offload none|optimizer|optimizer+params] [--fp32-grad-accum] [--live] [--save PATH]``
    ``memory.show(cluster if --live else None, n_params=P, dp=N, precision=...,
    optimizer=..., capacity_gb=GB, offload=..., fp32_grad_accum=...)``.
    Defaults: 7e9, 8, bf16-mixed, adam, 80, none.  ``--live`` (or a wrapped
    model on a running cluster): model size / DP / precision / optimizer from the
    wrapped model, plus measured bytes per rank beside
    :func:`dpnb.core.exact_rank_bytes` (difference in bytes).  ``--no-stages``
    (with ``--live``): the live panel alone, ``stages=False``.
    ``--during [--micro-batch B]``: ``residency.show(cluster, micro_batch=B)``
    runs one training step with the probe of :mod:`dpnb.engine.metrics.residency` and
    shows the peak parameter + gradient bytes per rank in forward and backward.

``%dp comm [--link NAME] [--n N] [--collectives all_reduce,reduce_scatter,all_gather] [--bandwidth GBs] [--latency US] [--save PATH]``
    ``comm.show(None, link=NAME, n=N, collectives=(...), bandwidth_gbs=GBs,
    latency_us=US)``.  Link names: ``nvlink4-h100``, ``ib-ndr-400``,
    ``ib-hdr-200``, ``pcie-gen4-x16``, ``ethernet-100g``, ``gloo-loopback``.

``%dp bench allreduce|reduce_scatter|all_gather [--sizes LO:HI:K] [--iters I] [--link NAME] [--save PATH]``
    ``comm.show_bench(cluster, sizes=comm.log_sizes(LO, HI, K), kind=...,
    iters=I, link=NAME)`` → returns a :class:`comm.BenchResult` (keep it in the
    notebook as ``_``).  Collective on every rank.  Default sizes 1 kB … 32 MB,
    8 points, 5 iterations.  ``--save``: ``comm.save(PATH, link=..., n=b.world_size,
    collectives=(kind,), bench=b)``.

``%dp scaling [--compute-ms MS] [--grad-bytes B] [--link NAME] [--overlap F] [--max-dp N] [--samples-per-rank S] [--live] [--save PATH]``
    ``scaling.show(cluster if --live else None, compute_ms=MS, grad_bytes=B,
    link=NAME, overlap=F, max_dp=N, samples_per_rank=S)``.  ``--live`` adds a
    measured point per world size found in rank 0's records and calibrates
    compute time / gradient bytes from them.

``%dp straggle --rank R --delay MS`` / ``%dp straggle --clear``
    ``stragglers.inject(cluster, R, MS)`` / ``stragglers.clear(cluster)``; print
    the returned per-rank delays.  No communication.

``%dp stragglers [--p P] [--n N] [--delay MS] [--save PATH]``
    ``stragglers.show(cluster, p=P, n=N, delay_ms=MS)``: per-rank compute and step
    time of the last steps (rank 0's records), and 1 − (1 − p)^N.

``%dp ring [--n N] [--size BYTES] [--numel E] [--step S] [--live] [--save PATH]``
    ``ring.show(cluster if --live else None, n=N, size_bytes=BYTES, numel=E)``;
    ``--live`` runs ``reduce_scatter_single`` + ``all_gather_single`` and
    ``all_reduce`` on every rank (collective) and shows they agree.
    ``--save``: ``ring.save(PATH, cluster, n=N, size_bytes=BYTES, step=S)``.

``%dp dashboard [--interval S]``
    ``dashboard.show(cluster, interval=S)``; live loss / throughput need
    ``train(..., publish=True)``.  ``box.stop()`` ends its poller thread.

``%%dp --profile [--profile-dir DIR]`` / ``%dp profile [--ranks R] [--save PATH]``
    ``cluster.profile(code)`` runs the cell with ``torch.profiler`` on every rank
    and keeps ``cluster.last_profile``; ``profile.show(cluster, ranks=R)`` shows
    it: compute and communication lanes per rank on one clock, exposed
    communication, entries into collectives (the straggler), the collectives'
    bus bandwidth beside the α–β model.

``%dp incidents [--save PATH]``
    ``incidents.show(cluster)``: each fault the notebook saw (``cluster.incidents``)
    with its time to healthy, on the run's timeline beside every step's loss and
    samples/s (each live rank's :func:`dpnb.engine.metrics.views.step_series`).

Engine-side helpers live in :mod:`dpnb.engine.metrics.views` (called by dotted name).
"""

from __future__ import annotations

import importlib
from typing import Any

from ._common import ViewError

VIEWS = ("gradsync", "batch", "memory", "comm", "scaling", "stragglers", "ring", "dashboard", "profile",
         "incidents")

__all__ = ["ViewError", "VIEWS", *VIEWS]


def __getattr__(name: str) -> Any:
    if name in VIEWS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

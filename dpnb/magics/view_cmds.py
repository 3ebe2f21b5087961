"""%dp subcommands: the views: each parses its options and shows a dpnb.widgets view.

Each handler carries its parser and help (see :mod:`.options`).
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from ..session.replica import peer_copy_line
from .options import save_option, subcommand


class ViewCommands:
    """Mixed into :class:`dpnb.magics.DPMagics` (``self._need()``, ``self.shell``)."""

    @subcommand("gradsync")
    @magic_arguments()
    @argument("--step", type=int, default=None,
              help="show this recorded step (default: the last; DDP keeps each train call's "
                   "last step and every 10th)")
    @argument("--last", type=int, default=3, help="recorded steps to fetch (default 3)")
    @argument("--cap-mb", type=float, default=None,
              help="bucket cap for the model's prediction beside the measured buckets")
    @argument("--link", default=None, help="link preset for the prediction (default: fitted)")
    @argument("--watch", action="store_true",
              help="only install the timing hooks (optimizer step, FSDP collectives)")
    @save_option
    def gradsync(self, a):
        """Gradient sync timeline per rank: backward, each bucket's all-reduce, optimizer."""
        from ..widgets import gradsync  # matplotlib: loaded when a view is asked for

        c = self._need()
        if a.watch:
            gradsync.watch(c)
            print("dpnb: timing hooks installed on every rank")
            return
        kw = self._kw(a, last="last", step="step", cap_mb="cap_mb", link="link")
        self._show("gradsync", a, c, kw)

    @subcommand("batch")
    @magic_arguments()
    @argument("--micro-batch", type=int, default=None)
    @argument("--dp", type=int, default=None)
    @argument("--grad-accum", type=int, default=None)
    @argument("--seq-len", type=int, default=None)
    @argument("--target-tokens", type=float, default=None)
    @argument("--ref-lr", type=float, default=None)
    @argument("--ref-batch", type=int, default=None)
    @argument("--tp", type=int, default=None)
    @argument("--pp", type=int, default=None)
    @argument("--gpus", type=int, default=None, help="world size to factor as DP x TP x PP")
    @argument("--live", action="store_true", help="fill in the cluster's DP and last %%dp train")
    @save_option
    def batch(self, a):
        """Global batch = micro-batch x DP x grad-accum (x seq-len), LR scaling, DP x TP x PP."""
        kw = self._kw(a, micro_batch="micro_batch", dp="dp", grad_accum="grad_accum",
                      seq_len="seq_len", target_tokens="target_tokens", ref_lr="ref_lr",
                      ref_batch="ref_batch", tp="tp", pp="pp", gpus="gpus")
        self._show("batch", a, self._live(a), kw)

    @subcommand("memory")
    @magic_arguments()
    @argument("--params", type=float, default=None, help="parameter count, e.g. 7e9")
    @argument("--dp", type=int, default=None)
    @argument("--precision", default=None, choices=("fp32", "bf16-mixed", "fp16-mixed"))
    @argument("--optimizer", default=None, choices=("adam", "adamw", "sgd-momentum", "sgd"))
    @argument("--capacity-gb", type=float, default=None, help="device memory line (default 80)")
    @argument("--offload", default=None, choices=("none", "optimizer", "optimizer+params"))
    @argument("--fp32-grad-accum", action="store_true")
    @argument("--live", action="store_true",
              help="the wrapped model on the cluster: measured bytes per rank beside the exact "
                   "prediction")
    @argument("--no-stages", action="store_true",
              help="with --live: the live model alone, without the ZeRO stage bars")
    @argument("--during", action="store_true",
              help="run one training step and show the parameter and gradient bytes each rank "
                   "held during its forward and backward (kept per strategy, to compare)")
    @argument("--micro-batch", type=int, default=8, help="with --during: samples per rank (default 8)")
    @save_option
    def memory(self, a):
        """Per-rank ZeRO memory for stages 0-3 (predicted, and measured with --live)."""
        if a.during:
            # lazy: matplotlib loads with the first view, not with %load_ext
            from ..widgets import residency

            runs = residency.show(self._need(), micro_batch=a.micro_batch)
            if a.save:
                print(f"dpnb: wrote {residency.save(a.save, runs)}")
            return None
        kw = self._kw(a, n_params="params", dp="dp", precision="precision",
                      optimizer="optimizer", capacity_gb="capacity_gb", offload="offload",
                      fp32_grad_accum="fp32_grad_accum")
        if "n_params" in kw:
            kw["n_params"] = int(kw["n_params"])
        if a.no_stages:
            if not a.live:
                raise UsageError("--no-stages goes with --live: without a live model there is "
                                 "nothing else to show")
            kw["stages"] = False
        self._show("memory", a, self._live(a), kw)
        c = self.cluster
        line = peer_copy_line(c) if c is not None and c.running else None
        for ln in (line or "").splitlines():  # K, each rank's CPU bytes, where copies are held
            print(f"dpnb: {ln}")

    @subcommand("comm")
    @magic_arguments()
    @argument("--link", default=None, help="nvlink4-h100, ib-ndr-400, ib-hdr-200, pcie-gen4-x16, "
                                           "ethernet-100g, gloo-loopback")
    @argument("--n", type=int, default=None, help="ranks")
    @argument("--collectives", default=None, help="comma list: all_reduce,reduce_scatter,all_gather")
    @argument("--bandwidth", type=float, default=None, help="custom link bandwidth in GB/s")
    @argument("--latency", type=float, default=None, help="custom link latency in microseconds")
    @save_option
    def comm(self, a):
        """alpha-beta model of collective time vs message size for a link."""
        kw = self._kw(a, link="link", n="n", bandwidth_gbs="bandwidth", latency_us="latency")
        if a.collectives:
            kw["collectives"] = tuple(x.strip() for x in a.collectives.split(",") if x.strip())
        self._show("comm", a, None, kw)

    @subcommand("bench")
    @magic_arguments()
    @argument("kind", choices=("allreduce", "all_reduce", "reduce_scatter", "all_gather", "hierarchical"))
    @argument("--sizes", default=None, metavar="LO:HI:K",
              help="K sizes from LO to HI bytes, log-spaced (default 1e3:3.2e7:8; hierarchical: 1 to 64 MiB)")
    @argument("--iters", type=int, default=5)
    @argument("--link", default=None, help="link preset to draw the model for")
    @argument("--hosts", type=int, default=None, metavar="K",
              help="hierarchical: split the ranks into K pretend hosts (default: the real hosts)")
    @argument("--flat", action="store_true",
              help="allreduce across hosts: one flat benchmark instead of intra- and inter-host links")
    @save_option
    def bench(self, a):
        """Run real collectives on the ranks over a range of sizes; algbw/busbw vs the model.

        On a cluster that spans hosts, allreduce measures the intra-host and the
        inter-host link each on its own, and flat vs two-level all-reduce
        (as hierarchical does)."""
        from ..widgets import comm  # matplotlib: loaded when a view is asked for

        c = self._need()
        kind = "all_reduce" if a.kind == "allreduce" else a.kind
        sizes = None
        if a.sizes:
            try:
                lo, hi, k = a.sizes.split(":")
                sizes = comm.log_sizes(float(lo), float(hi), int(k))
            except ValueError:
                raise UsageError(f"--sizes {a.sizes!r}: use LO:HI:K, e.g. 1e3:3.2e7:8") from None
        if a.iters < 1:
            raise UsageError("--iters must be >= 1")
        if kind == "hierarchical" or (kind == "all_reduce" and comm.spans_hosts(c) and not a.flat):
            # across hosts one fit would mix two links: measure each on its own
            from ..widgets import (
                hierarchy,  # matplotlib: loaded when a view is asked for
            )

            hb = hierarchy.show(c, sizes=sizes, iters=a.iters, hosts=a.hosts)
            if a.save:
                print(f"dpnb: wrote {hierarchy.save(a.save, hb)}")
            return hb
        b = comm.show_bench(c, sizes=sizes, kind=kind, iters=a.iters, link=a.link)
        if a.save:
            print(f"dpnb: wrote {comm.save(a.save, link=a.link or 'gloo-loopback', n=b.world_size, collectives=(kind,), bench=b)}")
        return b

    @subcommand("scaling")
    @magic_arguments()
    @argument("--compute-ms", type=float, default=None)
    @argument("--grad-bytes", type=float, default=None)
    @argument("--link", default=None)
    @argument("--overlap", type=float, default=None, help="fraction of comm hidden by compute, 0-1")
    @argument("--max-dp", type=int, default=None)
    @argument("--samples-per-rank", type=int, default=None)
    @argument("--live", action="store_true", help="add measured points from the records")
    @save_option
    def scaling(self, a):
        """Throughput and scaling efficiency vs DP degree."""
        kw = self._kw(a, compute_ms="compute_ms", grad_bytes="grad_bytes", link="link",
                      overlap="overlap", max_dp="max_dp", samples_per_rank="samples_per_rank")
        self._show("scaling", a, self._live(a), kw)

    @subcommand("incidents")
    @magic_arguments()
    @argument("--save", default=None, metavar="PATH", help="write the figure (.png or .svg)")
    def incidents(self, a):
        """What happened to this cluster: each death, call given up on or broken group,
        how long until every rank was alive and the group usable again, and (in Jupyter)
        each on the run's timeline beside the loss and samples/s of every step."""
        self._show("incidents", a, self._need(), {})

    @subcommand("straggle")
    @magic_arguments()
    @argument("--rank", type=int, default=None, help="rank to slow down")
    @argument("--delay", type=float, default=None, metavar="MS", help="extra ms per step")
    @argument("--clear", action="store_true", help="remove every injected delay")
    def straggle(self, a):
        """Inject a straggler: RANK sleeps MS milliseconds in every training step."""
        from ..widgets import stragglers  # matplotlib: loaded when a view is asked for

        c = self._need()
        if a.clear:
            stragglers.clear(c)
            print("dpnb: straggler delays cleared")
            return
        if a.rank is None or a.delay is None:
            raise UsageError("%dp straggle needs --rank R --delay MS (or --clear)")
        if a.delay < 0:
            raise UsageError("--delay must be >= 0 milliseconds")
        delays = stragglers.inject(c, a.rank, a.delay)
        print("dpnb: per-step delay by rank: " +
              ", ".join(f"rank {r}: {d * 1e3:g} ms" for r, d in enumerate(delays)))

    @subcommand("stragglers")
    @magic_arguments()
    @argument("--p", type=float, default=None, help="chance a rank straggles in a step")
    @argument("--n", type=int, default=None, help="ranks for the 1-(1-p)^N curve")
    @argument("--delay", type=float, default=None, metavar="MS")
    @save_option
    def stragglers(self, a):
        """Per-rank compute and step time of the last steps; the slowest rank gates the step."""
        kw = self._kw(a, p="p", n="n", delay_ms="delay")
        self._show("stragglers", a, self._need(), kw)

    @subcommand("profile")
    @magic_arguments()
    @argument("--ranks", default=None, help="the ranks whose lanes are drawn (default: up to 8)")
    @save_option
    def profile(self, a):
        """The last %%dp --profile: every rank's compute and communication on one clock,
        exposed communication, who entered each collective last, bus bandwidth vs model."""
        self._show("profile", a, self._need(), self._kw(a, ranks="ranks"))

    @subcommand("ring")
    @magic_arguments()
    @argument("--n", type=int, default=None, help="ranks in the drawn ring (default 4)")
    @argument("--size", type=float, default=None, help="message size in bytes")
    @argument("--numel", type=int, default=None, help="--live: elements per rank")
    @argument("--step", type=int, default=None, help="draw only this step")
    @argument("--live", action="store_true",
              help="run reduce_scatter_single + all_gather_single on the ranks and compare "
                   "with all_reduce")
    @save_option
    def ring(self, a):
        """Ring all-reduce step by step: reduce-scatter then all-gather."""
        kw = self._kw(a, n="n", size_bytes="size", numel="numel", step="step")
        self._show("ring", a, self._live(a), kw)

    @subcommand("dashboard")
    @magic_arguments()
    @argument("--interval", type=float, default=None, help="seconds between updates (default 1)")
    def dashboard(self, a):
        """Cluster status, live step/loss/throughput and memory per rank, updating while training."""
        from ..widgets import dashboard  # matplotlib: loaded when a view is asked for

        kw = self._kw(a, interval="interval")
        if self.live_dashboard is not None:  # one live dashboard per session: stop the old poller
            self.live_dashboard.stop()
        self.live_dashboard = dashboard.show(self._need(), **kw)

    def _live(self, a):
        return self._need() if getattr(a, "live", False) else None

    @staticmethod
    def _kw(a, **names):
        """Keyword arguments for a view: only the options the user gave."""
        # identity, not equality: 0 == False, and --dp 0 must reach validation
        return {key: getattr(a, attr) for key, attr in names.items()
                if getattr(a, attr) is not None and getattr(a, attr) is not False}

    def _show(self, module, a, cluster, kw):
        from .. import widgets  # matplotlib: loaded when a view is asked for

        view = getattr(widgets, module)
        if getattr(a, "save", None):
            path = view.save(a.save, cluster, **kw)
            print(f"dpnb: wrote {path}")
        else:
            view.show(cluster, **kw)

"""The ``%dp`` line magic and ``%%dp`` cell magic.

They only parse arguments (IPython ``magic_arguments``) and delegate to the
Python API in :mod:`dpnb.session` (the runtime :mod:`dpnb.cluster` under it,
and the view layers); anything a
magic does can be done from a script with ``dpnb.start(...)``.
"""

from __future__ import annotations

import logging
import shlex
import textwrap

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import parse_argstring

from . import cluster as cl
from . import session
from .session.resume import describe as describe_resume
from .errors import DpnbError, RemoteCellError
from .magic_args import SUBCOMMANDS as _SUBCOMMANDS
from .magic_args import _cell
from .cluster.types import Status

log = logging.getLogger(__name__)


def _is_dpnb_error(e: Exception) -> bool:
    return type(e).__module__.startswith("dpnb.")


def _help_text() -> str:
    parts = [
        "dpnb: data-parallel PyTorch from a notebook.",
        "",
        "  %dp start -n 2             start 2 engines in one process group",
        "  %%dp [--ranks 0,2]         run a cell on every (or the selected) rank",
        "  %dp status | stop | restart | push NAME... | pull NAME [--rank R]",
        "",
        "Every engine has rank, world_size, local_rank, device, torch and dist",
        "in its namespace.  Subcommands:",
        "",
    ]
    for name, f in _SUBCOMMANDS.items():
        parts.append(textwrap.dedent(f.__doc__ or "").strip())
        parts.append("")
    parts.append(textwrap.dedent(_cell.__doc__ or "").strip())
    return "\n".join(parts)


def _parse(stub, name: str, rest: str):
    try:
        return parse_argstring(stub, rest)
    except UsageError as e:
        raise UsageError(f"%dp {name}: {e}. See %dp? for usage.") from None
    except SystemExit:  # argparse on --help inside the magic parser
        raise UsageError(f"see %dp? for usage of %dp {name}") from None
    except ValueError as e:  # shlex: unbalanced quotes
        raise UsageError(f"%dp {name}: cannot parse arguments ({e}).") from None


@magics_class
class DPMagics(Magics):
    """Holds this IPython session's cluster (there is no global one)."""

    def __init__(self, shell=None):
        super().__init__(shell)
        self.cluster: session.Cluster | None = None
        self.dashboard = None  # the live dashboard widget, if one is shown
        self.warm = None  # a zygote importing torch ahead of %dp start (agents.WarmZygote)

    def prewarm(self) -> None:
        """Start a zygote now, so the next local ``%dp start`` skips torch's import."""
        from .cluster import agents, launch

        if self.warm is None and launch.prewarm_wanted():
            try:
                self.warm = agents.WarmZygote()
            except OSError as e:  # the start then imports torch itself, as without
                log.warning("could not start a warm zygote: %s", e)

    def drop_warm(self) -> None:
        if self.warm is not None:
            self.warm.close()
            self.warm = None

    # -------------------------------------------------------- entry point
    @line_cell_magic
    def dp(self, line: str = "", cell: str | None = None):
        try:
            if cell is not None:
                return self._run_cell(line, cell)
            return self._dispatch(line)
        except RemoteCellError:
            raise  # IPython shows its report via _render_traceback_
        except (DpnbError, ValueError) as e:
            # DpnbError, and the views' ViewError / core ConfigError (both
            # ValueErrors): bad input, told in one line
            if isinstance(e, ValueError) and not _is_dpnb_error(e):
                raise
            raise UsageError(str(e)) from None

    dp.__doc__ = _help_text()

    def _dispatch(self, line: str):
        try:
            words = shlex.split(line)
        except ValueError as e:
            raise UsageError(f"%dp: cannot parse {line!r} ({e}); see %dp?") from None
        if not words:
            raise UsageError("%dp needs a subcommand: " + ", ".join(_SUBCOMMANDS) + " (see %dp?)")
        name, rest = words[0], line.split(None, 1)[1] if len(line.split(None, 1)) > 1 else ""
        stub = _SUBCOMMANDS.get(name)
        if stub is None:
            raise UsageError(f"unknown %dp subcommand {name!r}: use one of "
                             + ", ".join(_SUBCOMMANDS) + " (see %dp?)")
        args = _parse(stub, name, rest)
        return getattr(self, "_do_" + name.replace("-", "_"))(args)

    def _need(self) -> session.Cluster:
        if self.cluster is None or not self.cluster.running:
            raise UsageError("no dpnb cluster is running: start one with %dp start -n 2")
        return self.cluster

    # -------------------------------------------------------- subcommands
    def _run_cell(self, line: str, cell: str):
        args = _parse(_cell, "(cell)", line)
        c = self._need()
        if not cell.strip():
            raise UsageError("%%dp cell is empty: put code to run on the ranks below %%dp")
        c.run(cell, ranks=args.ranks, timeout=args.timeout, stream=not args.no_stream,
              setup=args.setup, unchecked=args.unchecked)

    def _do_start(self, a):
        if self.cluster is not None and self.cluster.running:
            c = self.cluster
            raise UsageError(f"a dpnb cluster is already running ({c.world_size} ranks, "
                             f"{c.backend}): %dp stop it first, or %dp restart")
        c = session.Cluster.start(a.n, backend=a.backend, engines=a.engines, gpus=a.gpus,
                             timeout=a.timeout, threads=a.threads,
                             launcher_args=a.launcher_args, controller_ip=a.controller_ip,
                             env=a.env, remote_python=a.remote_python,
                             ssh_config=a.ssh_config, master_addr=a.master_addr,
                             zygote=False if a.no_zygote else None,
                             warm=None if a.no_zygote or a.keep else self.warm, keep=a.keep)
        self.warm = None  # taken by the start, or closed by it if unusable
        self.cluster = c
        devs = sorted({r.device for r in c.ranks})
        hosts = sorted({r.host for r in c.ranks})
        print(f"dpnb: {c.world_size} ranks up ({c.backend}, {', '.join(devs)}, "
              f"{len(hosts)} host{'s' if len(hosts) > 1 else ''}, group timeout "
              f"{c.timeout_s:g} s). Use %%dp to run cells on them.")
        if len(hosts) > 1:
            print(f"dpnb: {cl.placement.host_layout(c.ranks)}")
        if c.keep_s:
            from .cluster.keep import fmt_duration

            print(f"dpnb: kept: it outlives this kernel by {fmt_duration(c.keep_s)}; "
                  f"%dp attach in a new kernel takes it up, %dp stop ends it.")

    def _do_attach(self, a):
        if self.cluster is not None and self.cluster.running:
            raise UsageError("a dpnb cluster is already running in this kernel: %dp stop it "
                             "first (a kept one: end this kernel, and it stays)")
        c = self.cluster = session.Cluster.attach(a.id)
        print(f"dpnb: attached to kept cluster {c.cluster_id}: {c.world_size} ranks "
              f"({c.backend}), everything on the engines as it was; "
              f"{len(c.setup_log)} setup steps and {len(c.training.train_log)} train calls known.")

    def _do_list(self, a):
        from .cluster import keep

        recs = keep.kept()
        print("\n".join("dpnb: " + keep.describe(r) for r in recs) if recs else
              "dpnb: no kept clusters (start one with %dp start -n 2 --keep 2h)")

    def _do_stop(self, a):
        c = self._need()
        pids = c.stop()
        print(f"dpnb: cluster stopped ({len(pids)} processes).")
        if c.spec.zygote:  # a local cluster is usually followed by another
            self.prewarm()

    def _do_status(self, a):
        from .display import show_status

        show_status(self._need().status())

    def _do_restart(self, a):
        print("dpnb: " + self._need().restart(hard=a.hard, resume=a.resume))

    def _do_reform(self, a):
        info = self._need().reform()
        print(f"dpnb: process group re-formed on port {info['port']} "
              f"(generation {info['generation']}).")

    def _do_interrupt(self, a):
        self._need().interrupt(a.ranks)

    def _do_push(self, a):
        c = self._need()
        ns = self.shell.user_ns
        missing = [n for n in a.names if n not in ns]
        if missing:
            raise UsageError(f"not defined in the notebook: {', '.join(missing)}")
        c.push({n: ns[n] for n in a.names}, ranks=a.ranks)

    def _do_pull(self, a):
        return self._need().pull(a.name, rank=a.rank)

    def _do_wrap(self, a):
        info = self._need().wrap(a.model, a.strategy, bucket_cap_mb=a.bucket_cap_mb,
                                 mixed_precision=a.mixed_precision, cpu_offload=a.cpu_offload,
                                 wrap_classes=a.wrap_classes, optimizer=a.optimizer, lr=a.lr,
                                 weight_decay=a.weight_decay, momentum=a.momentum,
                                 model_out=a.out, comm_hook=a.comm_hook)
        notes = "".join(f"\n  note: {n}" for n in info.get("notes", []))
        hook = info.get("comm_hook", "none")
        via = "" if hook == "none" else f", gradients sent as {hook}"
        print(f"dpnb: {a.model} wrapped with {a.strategy}{via} on {info['world_size']} ranks "
              f"({info['n_params']:,} parameters, {info['local_param_numel']:,} on rank 0); "
              f"`{info['model_out']}` and `{info['optimizer_out']}` are ready.{notes}")

    def _do_data(self, a):
        info = self._need().set_data(a.dataset, seed=a.seed, shuffle=not a.no_shuffle)
        print(f"dpnb: training on {info['dataset']} ({info['len']:,} samples, "
              f"{info['per_rank']:,} per rank).")

    def _do_train(self, a):
        try:
            s = self._train(a)
        finally:
            if self.dashboard is not None:  # the live dashboard shows the run's end
                self.dashboard.catch_up()
        if s.get("batch_note"):
            print(f"dpnb: {s['batch_note']}")
        if s.get("data_note"):
            print(f"dpnb: note: {s['data_note']}")
        if s.get("checkpoints"):
            print(f"dpnb: checkpointed {len(s['checkpoints'])} time(s); latest "
                  f"{s['checkpoints'][-1]}")
        print(f"dpnb: {s['steps']} steps, global batch {s['global_batch']} = micro-batch "
              f"{s['micro_batch']} x DP {s['dp']} x grad-accum {s['grad_accum']}; "
              f"loss {s['loss']:.4f}" if s.get("loss") is not None else
              f"dpnb: {s['steps']} steps")

    def _train(self, a) -> dict:
        ck: dict = {}
        if a.checkpoint_every:
            k, d = a.checkpoint_every
            try:
                ck = {"checkpoint_every": int(k), "checkpoint_dir": d}
            except ValueError:
                raise UsageError(f"--checkpoint-every K DIR: K must be a whole number of steps "
                                 f"(got {k!r})") from None
        return self._need().train(**ck, steps=a.steps, epochs=a.epochs, micro_batch=a.micro_batch,
                               grad_accum=a.grad_accum, lr_scale=a.lr_scale,
                               ref_batch=a.ref_batch, seq_len=a.seq_len, step_fn=a.step_fn,
                               loss_fn=a.loss_fn, record=False if a.no_record else None,
                               timeout=a.timeout)

    def _do_resize(self, a):
        info = self._need().resize(a.n, keep="lr" if a.scale_lr else "batch",
                                   lr_rule=a.scale_lr or "linear", checkpoint_dir=a.dir)
        print(f"dpnb: {info['summary']}")

    def _do_export(self, a):
        info = self._need().export(a.dir)
        print(f"dpnb: wrote {', '.join(info['files'])} and checkpoint/ (step {info['step']}) to "
              f"{info['dir']}; run it with: {info['command']}")
        if info["skipped"]:
            print(f"dpnb: left out {len(info['skipped'])} (also in EXPORT.txt):")
            for what, why in info["skipped"]:
                print(f"  - {what}: {why}")

    def _do_check(self, a):
        v = self._need().check(a.model)
        print(("dpnb: OK, " if v["ok"] else "dpnb: MISMATCH, ") + v["summary"])
        return None if v["ok"] else v

    def _do_save(self, a):
        info = self._need().save(a.dir)
        print(f"dpnb: saved step {info.get('step')} to {info.get('path', a.dir)}")

    def _do_load(self, a):
        info = self._need().load(a.dir)
        print(f"dpnb: loaded step {info.get('step')} from {a.dir}")

    def _do_pull_model(self, a):
        return self._need().pull_model()

    # ------------------------------------------------------------- views
    def _live(self, a):
        return self._need() if getattr(a, "live", False) else None

    @staticmethod
    def _kw(a, **names):
        """Keyword arguments for a view: only the options the user gave."""
        # identity, not equality: 0 == False, and --dp 0 must reach validation
        return {key: getattr(a, attr) for key, attr in names.items()
                if getattr(a, attr) is not None and getattr(a, attr) is not False}

    def _show(self, module, a, cluster, kw):
        from . import widgets

        view = getattr(widgets, module)
        if getattr(a, "save", None):
            path = view.save(a.save, cluster, **kw) if module != "comm" else view.save(a.save, **kw)
            print(f"dpnb: wrote {path}")
        else:
            view.show(cluster, **kw)

    def _do_gradsync(self, a):
        from .widgets import gradsync

        c = self._need()
        if a.watch:
            gradsync.watch(c)
            print("dpnb: timing hooks installed on every rank")
            return
        kw = self._kw(a, last="last", step="step", cap_mb="cap_mb", link="link")
        self._show("gradsync", a, c, kw)

    def _do_batch(self, a):
        kw = self._kw(a, micro_batch="micro_batch", dp="dp", grad_accum="grad_accum",
                      seq_len="seq_len", target_tokens="target_tokens", ref_lr="ref_lr",
                      ref_batch="ref_batch", tp="tp", pp="pp", gpus="gpus")
        self._show("batch", a, self._live(a), kw)

    def _do_memory(self, a):
        if a.during:
            from .widgets import residency

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

    def _do_comm(self, a):
        kw = self._kw(a, link="link", n="n", bandwidth_gbs="bandwidth", latency_us="latency")
        if a.collectives:
            kw["collectives"] = tuple(x.strip() for x in a.collectives.split(",") if x.strip())
        self._show("comm", a, None, kw)

    def _do_bench(self, a):
        from .widgets import comm

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
            from .widgets import hierarchy

            hb = hierarchy.show(c, sizes=sizes, iters=a.iters, hosts=a.hosts)
            if a.save:
                print(f"dpnb: wrote {hierarchy.save(a.save, hb)}")
            return hb
        b = comm.show_bench(c, sizes=sizes, kind=kind, iters=a.iters, link=a.link)
        if a.save:
            print(f"dpnb: wrote {comm.save(a.save, link=a.link or 'gloo-loopback', n=b.world_size, collectives=(kind,), bench=b)}")
        return b

    def _do_scaling(self, a):
        kw = self._kw(a, compute_ms="compute_ms", grad_bytes="grad_bytes", link="link",
                      overlap="overlap", max_dp="max_dp", samples_per_rank="samples_per_rank")
        self._show("scaling", a, self._live(a), kw)

    def _do_straggle(self, a):
        from .widgets import stragglers

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

    def _do_stragglers(self, a):
        kw = self._kw(a, p="p", n="n", delay_ms="delay")
        self._show("stragglers", a, self._need(), kw)

    def _do_ring(self, a):
        kw = self._kw(a, n="n", size_bytes="size", numel="numel", step="step")
        self._show("ring", a, self._live(a), kw)

    def _do_dashboard(self, a):
        from .widgets import dashboard

        kw = self._kw(a, interval="interval")
        if self.dashboard is not None:  # one live dashboard per session: stop the old poller
            self.dashboard.stop()
        self.dashboard = dashboard.show(self._need(), **kw)

    def _do_where(self, a):
        print("dpnb: " + self._need().where(a.ranks).replace("\n", "\n  "))

    def _do_debug(self, a):
        text = self._need().debug(a.rank, commands=a.commands)
        if text:
            print(text)

    def _do_run(self, a):
        self._need().run_script(a.script, a.args, ranks=a.ranks, timeout=a.timeout,
                                unchecked=a.unchecked)

    def _do_setup(self, a):
        c = self._need()
        if a.clear:
            c.setup_log.clear()
            print("dpnb: setup log cleared; restart --resume will replay nothing")
            return
        lines = describe_resume(c) if c.setup_log.has_call("dpnb.engine.training.wrap") else []
        print("dpnb: restart --resume would replay, in order:\n  " + "\n  ".join(lines) if lines
              else "dpnb: nothing to replay yet: %dp wrap a model first (the cells that built "
                   "it are then found in this session's history)")

    def _do_log(self, a):
        from . import log as dlog

        rows = dlog.recent(a.last)
        print("\n".join(rows) if rows else "dpnb log: empty (nothing was caught)")
        if a.ranks:
            c = self._need()
            res = c.call("dpnb.engine.runner.log_records", a.last, raise_errors=False)
            for r in res.ranks:
                o = res.outcomes[r]
                got = o.value if o.status == Status.OK else [f"(no answer: {o.status})"]
                print(f"[rank {r}]\n" + ("\n".join(got) if got else "(empty)"))


def load(ip) -> DPMagics:
    m = DPMagics(ip)
    ip.register_magics(m)
    m.prewarm()
    return m


def get_magics(ip=None) -> DPMagics | None:
    if ip is None:
        from IPython import get_ipython

        ip = get_ipython()
    if ip is None:
        return None
    return ip.magics_manager.registry.get("DPMagics")

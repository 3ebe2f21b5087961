"""The ``%dp`` line magic and ``%%dp`` cell magic.

They only parse arguments (IPython ``magic_arguments``) and delegate to the
Python API in :mod:`dpnb.cluster` (and the training/view layers); anything a
magic does can be done from a script with ``dpnb.start(...)``.
"""

from __future__ import annotations

import shlex
import textwrap

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import cluster as cl
from .errors import DpnbError, RemoteCellError

_SUBCOMMANDS: dict[str, object] = {}


def _sub(name: str, prog: str | None = None):
    """Register a subcommand stub; its parser's usage line reads ``%dp NAME``."""

    def deco(f):
        f.parser.prog = prog or f"dp {name}"  # IPython prefixes the usage with %
        f.__doc__ = f.parser.format_help()
        if prog is None:
            _SUBCOMMANDS[name] = f
        return f

    return deco


# Each stub carries one subcommand's parser (magic_arguments keeps it on the
# function); the stubs are never called.

@_sub("start")
@magic_arguments()
@argument("-n", type=int, default=2, help="number of engines (ranks), default 2")
@argument("--backend", default="auto", choices=cl.BACKENDS,
          help="auto: nccl when every engine has its own GPU, else gloo")
@argument("--engines", default="local", choices=cl.LAUNCHERS,
          help="ipyparallel launcher for the engines (default local)")
@argument("--gpus", default=None, help="GPU ordinals to use per host, e.g. 0,1,2,3")
@argument("--timeout", type=float, default=cl.DEFAULT_TIMEOUT_S,
          help="process-group timeout in seconds: how long a collective waits for a "
               "peer before it errors (default %(default)s)")
@argument("--threads", type=int, default=None,
          help="torch threads per engine (default: cores / engines per host)")
@argument("--launcher-arg", action="append", default=None, dest="launcher_args",
          help="launcher setting (repeatable): an mpiexec option for mpi (e.g. "
               "--oversubscribe), KEY=VALUE for slurm (queue, account, timelimit, qos, "
               "options), HOST=N for ssh")
@argument("--controller-ip", default=None,
          help="address the controller listens on (default 127.0.0.1; use '*' so engines "
               "on other nodes can connect)")
def _start():
    """Start N engines and join them in one torch.distributed process group."""


@_sub("stop")
@magic_arguments()
def _stop():
    """Stop every process dpnb started (controller, engines)."""


@_sub("status")
@magic_arguments()
def _status():
    """Table of ranks: host, pid, device, backend, alive, memory in use."""


@_sub("restart")
@magic_arguments()
@argument("--hard", action="store_true", help="replace every engine (all state is lost)")
@argument("--resume", default=None, metavar="DIR",
          help="then rebuild the model on every rank (replaying the cells and the wrap that "
               "built it) and load the checkpoint in DIR")
def _restart():
    """Replace dead engines and re-form the process group; says what was lost."""


@_sub("reform")
@magic_arguments()
def _reform():
    """Destroy and re-create the process group on a fresh port (state kept)."""


@_sub("interrupt")
@magic_arguments()
@argument("--ranks", default=None, help="ranks to interrupt (default all)")
def _interrupt():
    """Send SIGINT (KeyboardInterrupt) to the engines of the selected ranks."""


@_sub("push")
@magic_arguments()
@argument("names", nargs="+", help="notebook variables to copy to the ranks")
@argument("--ranks", default=None, help="ranks to push to (default all)")
def _push():
    """Copy notebook variables into the ranks' namespaces."""


@_sub("pull")
@magic_arguments()
@argument("name", help="variable to fetch from the ranks")
@argument("--rank", type=int, default=None,
          help="fetch from this rank only (default: a list with one value per rank)")
def _pull():
    """Fetch a variable from the ranks (one value per rank, or --rank R)."""


@_sub("wrap")
@magic_arguments()
@argument("model", help="name of the torch.nn.Module defined on every rank")
@argument("--strategy", default="ddp", choices=("ddp", "zero1", "zero2", "zero3"),
          help="ddp: DistributedDataParallel; zero1: DDP + ZeroRedundancyOptimizer; "
               "zero2/zero3: FSDP2 fully_shard without/with resharding after forward")
@argument("--bucket-cap-mb", type=float, default=None,
          help="DDP gradient bucket size in MiB (default: DDP's 25, first bucket 1)")
@argument("--mixed-precision", default="none", choices=("none", "bf16", "fp16"),
          help="FSDP2 MixedPrecisionPolicy, autocast for DDP")
@argument("--cpu-offload", action="store_true", help="FSDP2: keep shards on the CPU")
@argument("--wrap", dest="wrap_classes", action="append", default=None,
          help="zero3/zero2: shard each submodule of this class name separately (repeatable)")
@argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd"),
          help="optimizer built on every rank (default adamw)")
@argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
@argument("--weight-decay", type=float, default=0.0)
@argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
@argument("--out", default="model", help="name of the wrapped model on the ranks (default model)")
def _wrap():
    """Wrap MODEL on every rank; the wrapped model and optimizer are `model`, `optimizer`."""


@_sub("data")
@magic_arguments()
@argument("dataset", help="name of a map-style Dataset defined on every rank")
@argument("--seed", type=int, default=0, help="DistributedSampler seed (default 0)")
@argument("--no-shuffle", action="store_true")
def _data():
    """Train on DATASET, sharded over the ranks with DistributedSampler."""


@_sub("train")
@magic_arguments()
@argument("--steps", type=int, default=None, help="optimizer steps to run")
@argument("--epochs", type=int, default=None, help="passes over the dataset (instead of --steps)")
@argument("--micro-batch", type=int, default=8, help="samples per rank per micro-batch (default 8)")
@argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
@argument("--lr-scale", default="none", choices=("none", "linear", "sqrt"),
          help="scale the lr with the global batch relative to --ref-batch")
@argument("--ref-batch", type=int, default=None, help="batch size the base lr was tuned for")
@argument("--seq-len", type=int, default=None, help="tokens per sample, for tokens/s")
@argument("--step-fn", default=None, help="name of a step(batch) -> loss function on the ranks")
@argument("--loss-fn", default=None, help="name of a loss_fn(output, target) on the ranks")
@argument("--no-record", action="store_true", help="do not record bucket timelines / bytes")
@argument("--timeout", type=float, default=None,
          help="wall-clock limit in seconds; ranks still running are interrupted and named")
def _train():
    """Run training steps with a live progress bar and loss curve (Ctrl-C stops cleanly)."""


@_sub("check")
@magic_arguments()
@argument("--model", default=None, help="model name (default: the wrapped one)")
def _check():
    """Are the replicas in sync?  Names the tensors that differ."""


@_sub("save")
@magic_arguments()
@argument("dir", help="checkpoint folder (torch.distributed.checkpoint)")
def _save():
    """Save model + optimizer + step (loadable under another strategy / world size)."""


@_sub("load")
@magic_arguments()
@argument("dir", help="checkpoint folder written by %%dp save")
def _load():
    """Load model + optimizer + step from DIR (no pickled objects are loaded)."""


@_sub("pull-model")
@magic_arguments()
def _pull_model():
    """Return the full, unwrapped state dict (gathered for FSDP) to the notebook."""


@_sub("gradsync")
@magic_arguments()
@argument("--step", type=int, default=None, help="show this recorded step (default: the last)")
@argument("--last", type=int, default=3, help="recorded steps to fetch (default 3)")
@argument("--cap-mb", type=float, default=None,
          help="bucket cap for the model's prediction beside the measured buckets")
@argument("--link", default=None, help="link preset for the prediction (default: fitted)")
@argument("--watch", action="store_true",
          help="only install the timing hooks (optimizer step, FSDP collectives)")
@argument("--save", default=None, metavar="PATH", help="write the figure (.png/.svg)")
def _gradsync():
    """Gradient sync timeline per rank: backward, each bucket's all-reduce, optimizer."""


@_sub("batch")
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
@argument("--save", default=None, metavar="PATH")
def _batch():
    """Global batch = micro-batch x DP x grad-accum (x seq-len), LR scaling, DP x TP x PP."""


@_sub("memory")
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
@argument("--save", default=None, metavar="PATH")
def _memory():
    """Per-rank ZeRO memory for stages 0-3 (predicted, and measured with --live)."""


@_sub("comm")
@magic_arguments()
@argument("--link", default=None, help="nvlink4-h100, ib-ndr-400, ib-hdr-200, pcie-gen4-x16, "
                                       "ethernet-100g, gloo-loopback")
@argument("--n", type=int, default=None, help="ranks")
@argument("--collectives", default=None, help="comma list: all_reduce,reduce_scatter,all_gather")
@argument("--bandwidth", type=float, default=None, help="custom link bandwidth in GB/s")
@argument("--latency", type=float, default=None, help="custom link latency in microseconds")
@argument("--save", default=None, metavar="PATH")
def _comm():
    """alpha-beta model of collective time vs message size for a link."""


@_sub("bench")
@magic_arguments()
@argument("kind", choices=("allreduce", "all_reduce", "reduce_scatter", "all_gather"))
@argument("--sizes", default=None, metavar="LO:HI:K",
          help="K sizes from LO to HI bytes, log-spaced (default 1e3:3.2e7:8)")
@argument("--iters", type=int, default=5)
@argument("--link", default=None, help="link preset to draw the model for")
@argument("--save", default=None, metavar="PATH")
def _bench():
    """Run real collectives on the ranks over a range of sizes; algbw/busbw vs the model."""


@_sub("scaling")
@magic_arguments()
@argument("--compute-ms", type=float, default=None)
@argument("--grad-bytes", type=float, default=None)
@argument("--link", default=None)
@argument("--overlap", type=float, default=None, help="fraction of comm hidden by compute, 0-1")
@argument("--max-dp", type=int, default=None)
@argument("--samples-per-rank", type=int, default=None)
@argument("--live", action="store_true", help="add measured points from the records")
@argument("--save", default=None, metavar="PATH")
def _scaling():
    """Throughput and scaling efficiency vs DP degree."""


@_sub("straggle")
@magic_arguments()
@argument("--rank", type=int, default=None, help="rank to slow down")
@argument("--delay", type=float, default=None, metavar="MS", help="extra ms per step")
@argument("--clear", action="store_true", help="remove every injected delay")
def _straggle():
    """Inject a straggler: RANK sleeps MS milliseconds in every training step."""


@_sub("stragglers")
@magic_arguments()
@argument("--p", type=float, default=None, help="chance a rank straggles in a step")
@argument("--n", type=int, default=None, help="ranks for the 1-(1-p)^N curve")
@argument("--delay", type=float, default=None, metavar="MS")
@argument("--save", default=None, metavar="PATH")
def _stragglers():
    """Per-rank compute and step time of the last steps; the slowest rank gates the step."""


@_sub("ring")
@magic_arguments()
@argument("--n", type=int, default=None, help="ranks in the drawn ring (default 4)")
@argument("--size", type=float, default=None, help="message size in bytes")
@argument("--numel", type=int, default=None, help="--live: elements per rank")
@argument("--step", type=int, default=None, help="draw only this step")
@argument("--live", action="store_true",
          help="run reduce_scatter_tensor + all_gather_into_tensor on the ranks and compare "
               "with all_reduce")
@argument("--save", default=None, metavar="PATH")
def _ring():
    """Ring all-reduce step by step: reduce-scatter then all-gather."""


@_sub("dashboard")
@magic_arguments()
@argument("--interval", type=float, default=None, help="seconds between updates (default 1)")
def _dashboard():
    """Cluster status, live step/loss/throughput and memory per rank, updating while training."""


@_sub("(cell)", prog="%dp")
@magic_arguments()
@argument("--ranks", default=None,
          help="ranks to run on: 0 | 0,2 | 1: | :2 | 0-2 | all (default all)")
@argument("--timeout", type=float, default=None,
          help="wall-clock limit for the cell in seconds; ranks still running are "
               "interrupted and reported")
@argument("--no-stream", action="store_true",
          help="do not stream output while the cell runs")
def _cell():
    """%%dp [--ranks SPEC] [--timeout S]: run the cell on the selected ranks."""


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
        self.cluster: cl.Cluster | None = None

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

    def _need(self) -> cl.Cluster:
        if self.cluster is None or not self.cluster.running:
            raise UsageError("no dpnb cluster is running: start one with %dp start -n 2")
        return self.cluster

    # -------------------------------------------------------- subcommands
    def _run_cell(self, line: str, cell: str):
        args = _parse(_cell, "(cell)", line)
        c = self._need()
        if not cell.strip():
            raise UsageError("%%dp cell is empty: put code to run on the ranks below %%dp")
        c.run(cell, ranks=args.ranks, timeout=args.timeout, stream=not args.no_stream)

    def _do_start(self, a):
        if self.cluster is not None and self.cluster.running:
            c = self.cluster
            raise UsageError(f"a dpnb cluster is already running ({c.world_size} ranks, "
                             f"{c.backend}): %dp stop it first, or %dp restart")
        c = cl.Cluster.start(a.n, backend=a.backend, engines=a.engines, gpus=a.gpus,
                             timeout=a.timeout, threads=a.threads,
                             launcher_args=a.launcher_args, controller_ip=a.controller_ip)
        self.cluster = c
        devs = sorted({r.device for r in c.ranks})
        hosts = sorted({r.host for r in c.ranks})
        print(f"dpnb: {c.world_size} ranks up ({c.backend}, {', '.join(devs)}, "
              f"{len(hosts)} host{'s' if len(hosts) > 1 else ''}, group timeout "
              f"{c.timeout_s:g} s). Use %%dp to run cells on them.")

    def _do_stop(self, a):
        c = self._need()
        pids = c.stop()
        print(f"dpnb: cluster stopped ({len(pids)} processes).")

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
                                 model_out=a.out)
        notes = "".join(f"\n  note: {n}" for n in info.get("notes", []))
        print(f"dpnb: {a.model} wrapped with {a.strategy} on {info['world_size']} ranks "
              f"({info['n_params']:,} parameters, {info['local_param_numel']:,} on rank 0); "
              f"`{info['model_out']}` and `{info['optimizer_out']}` are ready.{notes}")

    def _do_data(self, a):
        info = self._need().set_data(a.dataset, seed=a.seed, shuffle=not a.no_shuffle)
        print(f"dpnb: training on {info['dataset']} ({info['len']:,} samples, "
              f"{info['per_rank']:,} per rank).")

    def _do_train(self, a):
        s = self._need().train(steps=a.steps, epochs=a.epochs, micro_batch=a.micro_batch,
                               grad_accum=a.grad_accum, lr_scale=a.lr_scale,
                               ref_batch=a.ref_batch, seq_len=a.seq_len, step_fn=a.step_fn,
                               loss_fn=a.loss_fn, record=False if a.no_record else None,
                               timeout=a.timeout)
        print(f"dpnb: {s['steps']} steps, global batch {s['global_batch']} = micro-batch "
              f"{s['micro_batch']} x DP {s['dp']} x grad-accum {s['grad_accum']}; "
              f"loss {s['loss']:.4f}" if s.get("loss") is not None else
              f"dpnb: {s['steps']} steps")

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
        kw = self._kw(a, n_params="params", dp="dp", precision="precision",
                      optimizer="optimizer", capacity_gb="capacity_gb", offload="offload",
                      fp32_grad_accum="fp32_grad_accum")
        if "n_params" in kw:
            kw["n_params"] = int(kw["n_params"])
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
        dashboard.show(self._need(), **kw)


def load(ip) -> DPMagics:
    m = DPMagics(ip)
    ip.register_magics(m)
    return m


def get_magics(ip=None) -> DPMagics | None:
    if ip is None:
        from IPython import get_ipython

        ip = get_ipython()
    if ip is None:
        return None
    return ip.magics_manager.registry.get("DPMagics")

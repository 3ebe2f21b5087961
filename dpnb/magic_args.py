"""The parsers of every ``%dp`` subcommand and of ``%%dp`` (IPython ``magic_arguments``).

Each stub function carries one subcommand's parser (``magic_arguments`` keeps
it on the function) and its help; the stubs are never called.
:mod:`dpnb.magics` looks subcommands up in :data:`SUBCOMMANDS`, parses with
them and delegates.
"""

from __future__ import annotations

import argparse

from IPython.core.magic_arguments import argument, magic_arguments

from .cluster.types import BACKENDS, DEFAULT_TIMEOUT_S, LAUNCHERS
from .core.strategies import LR_SCALES, MIXED_PRECISION, OPTIMIZERS, STRATEGIES

SUBCOMMANDS: dict[str, object] = {}


def sub(name: str, prog: str | None = None):
    """Register a subcommand stub; its parser's usage line reads ``%dp NAME``."""

    def deco(f):
        f.parser.prog = prog or f"dp {name}"  # IPython prefixes the usage with %
        f.__doc__ = f.parser.format_help()
        if prog is None:
            SUBCOMMANDS[name] = f
        return f

    return deco


# Each stub carries one subcommand's parser (magic_arguments keeps it on the
# function); the stubs are never called.

@sub("start")
@magic_arguments()
@argument("-n", type=int, default=2, help="number of engines (ranks), default 2")
@argument("--backend", default="auto", choices=BACKENDS,
          help="auto: nccl when every engine has its own GPU, else gloo")
@argument("--engines", default="local", choices=LAUNCHERS,
          help="ipyparallel launcher for the engines (default local)")
@argument("--gpus", default=None, help="GPU ordinals to use per host, e.g. 0,1,2,3")
@argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
          help="process-group timeout in seconds: how long a collective waits for a "
               "peer before it errors (default %(default)s)")
@argument("--threads", type=int, default=None,
          help="torch threads per engine (default: cores / engines per host)")
@argument("--launcher-arg", action="append", default=None, dest="launcher_args",
          help="launcher setting (repeatable): HOST=N for ssh (N engines on HOST), an "
               "mpiexec option for mpi (e.g. --hostfile F), KEY=VALUE for slurm (queue, "
               "account, timelimit, qos, nodes, options)")
@argument("--env", action="append", default=None, metavar="KEY=VALUE",
          help="environment variable for every engine on every launcher (repeatable), "
               "e.g. --env GLOO_SOCKET_IFNAME=eth1 --env NCCL_DEBUG=INFO")
@argument("--remote-python", default=None, metavar="PATH",
          help="the Python to run on other hosts (ssh), one that has dpnb installed "
               "(default: python3 on the remote PATH)")
@argument("--ssh-config", default=None, metavar="FILE", help="ssh config file for --engines ssh")
@argument("--keep", default=None, metavar="TTL",
          help="leave the cluster running when this kernel exits, for TTL (e.g. 30m, 2h, 1d) "
               "after the last kernel lets go; %%dp attach in a new kernel takes it up again "
               "(local engines)")
@argument("--no-zygote", action="store_true",
          help="local engines: start each as its own Python (each imports torch) instead of "
               "forking them from one process that imported torch once")
@argument("--master-addr", default=None,
          help="address of rank 0 the other ranks reach the process group's store on "
               "(default: rank 0's address on its route to the controller)")
@argument("--controller-ip", default=None,
          help="address the controller listens on (default: loopback for local engines, "
               "this host's address towards the first host for ssh, all interfaces for "
               "slurm)")
def _start():
    """Start N engines and join them in one torch.distributed process group."""


@sub("stop")
@magic_arguments()
def _stop():
    """Stop every process dpnb started (controller, engines)."""


@sub("attach")
@magic_arguments()
@argument("id", nargs="?", default=None, help="which kept cluster (see %%dp list); "
          "default: the only one")
def _attach():
    """Take up a cluster a kernel left running with %%dp start --keep: its engines, their
    state, the setup log and train history."""


@sub("list")
@magic_arguments()
def _list():
    """The kept clusters (%%dp start --keep): ranks, age, time to live, which kernel holds them."""


@sub("status")
@magic_arguments()
def _status():
    """Table of ranks: host, pid, device, backend, alive, memory in use."""


@sub("restart")
@magic_arguments()
@argument("--hard", action="store_true", help="replace every engine (all state is lost)")
@argument("--resume", default=None, metavar="DIR", nargs="?", const="",
          help="then rebuild the model on every rank (replaying the %%%%dp --setup cells, the "
               "wrap and the data) and load the checkpoint in DIR (no DIR: the latest one "
               "%%dp train --checkpoint-every wrote)")
def _restart():
    """Replace dead engines and re-form the process group; says what was lost."""


@sub("reform")
@magic_arguments()
def _reform():
    """Destroy and re-create the process group on a fresh port (state kept)."""


@sub("interrupt")
@magic_arguments()
@argument("--ranks", default=None, help="ranks to interrupt (default all)")
def _interrupt():
    """Send SIGINT (KeyboardInterrupt) to the engines of the selected ranks."""


@sub("push")
@magic_arguments()
@argument("names", nargs="+", help="notebook variables to copy to the ranks")
@argument("--ranks", default=None, help="ranks to push to (default all)")
def _push():
    """Copy notebook variables into the ranks' namespaces."""


@sub("pull")
@magic_arguments()
@argument("name", help="variable to fetch from the ranks")
@argument("--rank", type=int, default=None,
          help="fetch from this rank only (default: a list with one value per rank)")
def _pull():
    """Fetch a variable from the ranks (one value per rank, or --rank R)."""


@sub("wrap")
@magic_arguments()
@argument("model", help="name of the torch.nn.Module defined on every rank")
@argument("--strategy", default="ddp", choices=STRATEGIES,
          help="ddp: DistributedDataParallel; zero1: DDP + ZeroRedundancyOptimizer; "
               "zero2/zero3: FSDP2 fully_shard without/with resharding after forward")
@argument("--bucket-cap-mb", type=float, default=None,
          help="DDP gradient bucket size in MiB (default: DDP's 25, first bucket 1)")
@argument("--comm-hook", default="none",
          help="ddp/zero1 gradient compression: none, fp16, bf16 (16-bit buckets: half the "
               "bytes) or powersgd[:R] (rank-R factors of each gradient matrix)")
@argument("--mixed-precision", default="none", choices=MIXED_PRECISION,
          help="FSDP2 MixedPrecisionPolicy, autocast for DDP")
@argument("--cpu-offload", action="store_true", help="FSDP2: keep shards on the CPU")
@argument("--wrap", dest="wrap_classes", action="append", default=None,
          help="zero3/zero2: shard each submodule of this class name separately (repeatable)")
@argument("--optimizer", default="adamw", choices=OPTIMIZERS,
          help="optimizer built on every rank (default adamw)")
@argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
@argument("--weight-decay", type=float, default=0.0)
@argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
@argument("--out", default="model", help="name of the wrapped model on the ranks (default model)")
def _wrap():
    """Wrap MODEL on every rank; the wrapped model and optimizer are `model`, `optimizer`."""


@sub("data")
@magic_arguments()
@argument("dataset", help="name of a map-style Dataset defined on every rank")
@argument("--seed", type=int, default=0, help="DistributedSampler seed (default 0)")
@argument("--no-shuffle", action="store_true")
def _data():
    """Train on DATASET, sharded over the ranks with DistributedSampler."""


@sub("train")
@magic_arguments()
@argument("--steps", type=int, default=None, help="optimizer steps to run")
@argument("--epochs", type=int, default=None, help="passes over the dataset (instead of --steps)")
@argument("--micro-batch", type=int, default=None,
          help="samples per rank per micro-batch (default 8, or what %%dp resize chose)")
@argument("--grad-accum", type=int, default=None,
          help="micro-batches per optimizer step (default 1, or what %%dp resize chose to keep "
               "the global batch)")
@argument("--lr-scale", default="none", choices=LR_SCALES,
          help="scale the lr with the global batch relative to --ref-batch")
@argument("--ref-batch", type=int, default=None, help="batch size the base lr was tuned for")
@argument("--seq-len", type=int, default=None, help="tokens per sample, for tokens/s")
@argument("--step-fn", default=None, help="name of a step(batch) -> loss function on the ranks")
@argument("--loss-fn", default=None, help="name of a loss_fn(output, target) on the ranks")
@argument("--no-record", action="store_true", help="do not record bucket timelines / bytes")
@argument("--timeout", type=float, default=None,
          help="wall-clock limit in seconds; ranks still running are interrupted and named")
@argument("--checkpoint-every", nargs=2, default=None, metavar=("K", "DIR"),
          help="checkpoint into DIR every K steps; %%dp restart --resume loads the latest")
def _train():
    """Run training steps with a live progress bar and loss curve (Ctrl-C stops cleanly)."""


@sub("resize")
@magic_arguments()
@argument("-n", type=int, required=True, help="the number of ranks to go on with")
@argument("--scale-lr", default=None, choices=("linear", "sqrt"),
          help="keep micro-batch and grad-accum and rescale the learning rate with the "
               "global batch instead of keeping the global batch (the default)")
@argument("--dir", default=None, metavar="DIR",
          help="where the hand-over checkpoint goes (default: the cluster's profile folder; "
               "on several hosts give storage every host sees)")
def _resize():
    """Go on training on N ranks: checkpoint, stop or add engines, re-form the group,
    replay the --setup cells and the wrap, reload (DCP reshards); the global batch is
    kept by a new grad-accum unless --scale-lr."""


@sub("export")
@magic_arguments()
@argument("dir", help="folder for train.py, run.sh, job.sbatch, EXPORT.txt and the checkpoint")
def _export():
    """Write this session as a batch job: the --setup cells, the wrap, the data and the
    train calls as train.py (torchrun), with run.sh, a Slurm job.sbatch and a checkpoint of
    the current state; what cannot be carried over is listed with its reason."""


@sub("check")
@magic_arguments()
@argument("--model", default=None, help="model name (default: the wrapped one)")
def _check():
    """Are the replicas in sync?  Names the tensors that differ."""


@sub("save")
@magic_arguments()
@argument("dir", help="checkpoint folder (torch.distributed.checkpoint)")
def _save():
    """Save model + optimizer + step (loadable under another strategy / world size)."""


@sub("load")
@magic_arguments()
@argument("dir", help="checkpoint folder written by %%dp save")
def _load():
    """Load model + optimizer + step from DIR (no pickled objects are loaded)."""


@sub("pull-model")
@magic_arguments()
def _pull_model():
    """Return the full, unwrapped state dict (gathered for FSDP) to the notebook."""


@sub("gradsync")
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


@sub("batch")
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


@sub("memory")
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
@argument("--save", default=None, metavar="PATH")
def _memory():
    """Per-rank ZeRO memory for stages 0-3 (predicted, and measured with --live)."""


@sub("comm")
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


@sub("bench")
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
@argument("--save", default=None, metavar="PATH")
def _bench():
    """Run real collectives on the ranks over a range of sizes; algbw/busbw vs the model.

    On a cluster that spans hosts, allreduce measures the intra-host and the
    inter-host link each on its own, and flat vs two-level all-reduce
    (as hierarchical does)."""


@sub("scaling")
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


@sub("straggle")
@magic_arguments()
@argument("--rank", type=int, default=None, help="rank to slow down")
@argument("--delay", type=float, default=None, metavar="MS", help="extra ms per step")
@argument("--clear", action="store_true", help="remove every injected delay")
def _straggle():
    """Inject a straggler: RANK sleeps MS milliseconds in every training step."""


@sub("stragglers")
@magic_arguments()
@argument("--p", type=float, default=None, help="chance a rank straggles in a step")
@argument("--n", type=int, default=None, help="ranks for the 1-(1-p)^N curve")
@argument("--delay", type=float, default=None, metavar="MS")
@argument("--save", default=None, metavar="PATH")
def _stragglers():
    """Per-rank compute and step time of the last steps; the slowest rank gates the step."""


@sub("ring")
@magic_arguments()
@argument("--n", type=int, default=None, help="ranks in the drawn ring (default 4)")
@argument("--size", type=float, default=None, help="message size in bytes")
@argument("--numel", type=int, default=None, help="--live: elements per rank")
@argument("--step", type=int, default=None, help="draw only this step")
@argument("--live", action="store_true",
          help="run reduce_scatter_single + all_gather_single on the ranks and compare "
               "with all_reduce")
@argument("--save", default=None, metavar="PATH")
def _ring():
    """Ring all-reduce step by step: reduce-scatter then all-gather."""


@sub("dashboard")
@magic_arguments()
@argument("--interval", type=float, default=None, help="seconds between updates (default 1)")
def _dashboard():
    """Cluster status, live step/loss/throughput and memory per rank, updating while training."""


@sub("where")
@magic_arguments()
@argument("--ranks", default=None, help="ranks to ask (default all)")
def _where():
    """Where each rank is: idle, or running which cell line, inside which collective."""


@sub("debug")
@magic_arguments()
@argument("--rank", type=int, default=None, help="rank to inspect (default: the first that raised)")
@argument("-c", "--command", action="append", default=None, dest="commands", metavar="CMD",
          help="a pdb command to run instead of prompting (repeatable; then q)")
def _debug():
    """pdb post mortem of the last failed cell on a rank, its prompt in the notebook
    (where no prompt is possible: its frames, with their locals)."""


@sub("run")
@magic_arguments()
@argument("--ranks", default=None, help="ranks to run it on (default all)")
@argument("--timeout", type=float, default=None,
          help="wall-clock limit in seconds; ranks still running are interrupted and reported")
@argument("--unchecked", action="store_true", help="do not check its collectives across ranks")
@argument("script", help="the Python script, as you would give it to torchrun")
@argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
def _run():
    """Run a torchrun script on every rank as torchrun would (__main__, sys.argv, RANK,
    LOCAL_RANK, ...); its module globals are then in each rank's namespace."""


@sub("setup")
@magic_arguments()
@argument("--clear", action="store_true", help="forget every recorded setup step")
def _setup():
    """What restart --resume would replay now: the cells that built the model and data
    (marked --setup or found in the history), then the wrap and data calls."""


@sub("log")
@magic_arguments()
@argument("--last", type=int, default=20, help="records to show (default 20)")
@argument("--ranks", action="store_true", help="also each rank's engine log")
def _log():
    """dpnb's log: every exception dpnb caught and did not raise (DPNB_LOG=debug: live)."""


@sub("(cell)", prog="%dp")
@magic_arguments()
@argument("--ranks", default=None,
          help="ranks to run on: 0 | 0,2 | 1: | :2 | 0-2 | all (default all)")
@argument("--timeout", type=float, default=None,
          help="wall-clock limit for the cell in seconds; ranks still running are "
               "interrupted and reported")
@argument("--no-stream", action="store_true",
          help="do not stream output while the cell runs")
@argument("--setup", action="store_true",
          help="record this cell (once it succeeds on every rank) for restart --resume")
@argument("--unchecked", action="store_true",
          help="do not check this cell's collectives across ranks first (hot hand-written "
               "loops; a mismatch may then abort gloo)")
def _cell():
    """%%dp [--ranks SPEC] [--timeout S] [--setup] [--unchecked]: run the cell on the selected ranks."""

"""%dp subcommands: the training verbs: wrap, data, train, resize, check, checkpoints.

Each handler carries its parser and help (see :mod:`.options`).
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from ..core.peerplan import parse_every
from ..core.strategies import LR_SCALES, MIXED_PRECISION, OPTIMIZERS, STRATEGIES
from ..core.trainargs import TrainArgs
from ..session.profile import MAX_PROFILED_STEPS
from .options import profile_options, subcommand


class TrainingCommands:
    """Mixed into :class:`dpnb.magics.DPMagics` (``self._need()``, ``self.shell``)."""

    @subcommand("wrap")
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
    def wrap(self, a):
        """Wrap MODEL on every rank; the wrapped model and optimizer are `model`, `optimizer`."""
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

    @subcommand("data")
    @magic_arguments()
    @argument("dataset", help="name of a map-style Dataset defined on every rank")
    @argument("--seed", type=int, default=0, help="DistributedSampler seed (default 0)")
    @argument("--no-shuffle", action="store_true")
    def data(self, a):
        """Train on DATASET, sharded over the ranks with DistributedSampler."""
        info = self._need().set_data(a.dataset, seed=a.seed, shuffle=not a.no_shuffle)
        print(f"dpnb: training on {info['dataset']} ({info['len']:,} samples, "
              f"{info['per_rank']:,} per rank).")

    @subcommand("train")
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
    @argument("--peer-copy-every", default=None, metavar="K",
              help="zero1/2/3: copy each rank's shard into its neighbour's CPU memory every K "
                   "steps (default 10; off: none); kept for later calls")
    @profile_options("the steps (a few: --steps 3 --profile)")
    def train(self, a):
        """Run training steps with a live progress bar and loss curve (Ctrl-C stops cleanly)."""
        if a.profile and (a.steps is None or a.steps > MAX_PROFILED_STEPS):
            raise UsageError(f"profile a few steps, not a whole run: --steps 3 --profile (at most "
                             f"{MAX_PROFILED_STEPS}: the profiler keeps every event in memory)")
        try:
            s = self._profiled(a, "train", lambda: self._train(a))
        finally:
            if self.live_dashboard is not None:  # the live dashboard shows the run's end
                self.live_dashboard.catch_up()
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

    @subcommand("resize")
    @magic_arguments()
    @argument("-n", type=int, required=True, help="the number of ranks to go on with")
    @argument("--scale-lr", default=None, choices=("linear", "sqrt"),
              help="keep micro-batch and grad-accum and rescale the learning rate with the "
                   "global batch instead of keeping the global batch (the default)")
    @argument("--dir", default=None, metavar="DIR",
              help="where the hand-over checkpoint goes (default: the cluster's profile folder; "
                   "on several hosts give storage every host sees)")
    def resize(self, a):
        """Go on training on N ranks: checkpoint, stop or add engines, re-form the group,
        replay the --setup cells and the wrap, reload (DCP reshards); the global batch is
        kept by a new grad-accum unless --scale-lr."""
        info = self._need().resize(a.n, keep="lr" if a.scale_lr else "batch",
                                   lr_rule=a.scale_lr or "linear", checkpoint_dir=a.dir)
        print(f"dpnb: {info['summary']}")

    @subcommand("check")
    @magic_arguments()
    @argument("--model", default=None, help="model name (default: the wrapped one)")
    def check(self, a):
        """Are the replicas in sync?  Names the tensors that differ."""
        v = self._need().check(a.model)
        print(("dpnb: OK, " if v["ok"] else "dpnb: MISMATCH, ") + v["summary"])
        return None if v["ok"] else v

    @subcommand("save")
    @magic_arguments()
    @argument("dir", help="checkpoint folder (torch.distributed.checkpoint)")
    def save(self, a):
        """Save model + optimizer + step (loadable under another strategy / world size)."""
        info = self._need().save(a.dir)
        print(f"dpnb: saved step {info.get('step')} to {info.get('path', a.dir)}")

    @subcommand("load")
    @magic_arguments()
    @argument("dir", help="checkpoint folder written by %%dp save")
    def load(self, a):
        """Load model + optimizer + step from DIR (no pickled objects are loaded)."""
        info = self._need().load(a.dir)
        print(f"dpnb: loaded step {info.get('step')} from {a.dir}")

    @subcommand("pull-model")
    @magic_arguments()
    def pull_model(self, a):
        """Return the full, unwrapped state dict (gathered for FSDP) to the notebook."""
        return self._need().pull_model()

    def _train(self, a) -> dict:
        ck: dict = {}
        if a.checkpoint_every:
            k, d = a.checkpoint_every
            try:
                ck = {"checkpoint_every": int(k), "checkpoint_dir": d}
            except ValueError:
                raise UsageError(f"--checkpoint-every K DIR: K must be a whole number of steps "
                                 f"(got {k!r})") from None
        if a.peer_copy_every is not None:
            ck["peer_copy_every"] = parse_every(a.peer_copy_every)
            print(f"dpnb: peer copies every {ck['peer_copy_every']} steps" if ck["peer_copy_every"]
                  else "dpnb: peer copies off")
        return self._need().train(TrainArgs(
            **ck, steps=a.steps, epochs=a.epochs, micro_batch=a.micro_batch,
            grad_accum=a.grad_accum, lr_scale=a.lr_scale, ref_batch=a.ref_batch,
            seq_len=a.seq_len, step_fn=a.step_fn, loss_fn=a.loss_fn,
            record=False if a.no_record else None, timeout=a.timeout))

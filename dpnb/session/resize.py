"""``%dp resize -n M``: go on training on another number of ranks.

The sequence, each step only once the one before it succeeded:

1. check everything that could make it fail (target size, a wrapped model,
   the cells that build it marked ``%%dp --setup``, the batch arithmetic of
   :func:`dpnb.core.resize.plan_resize`) -- a refused resize changes nothing;
2. every rank writes its shard of model and optimizer state, the step and the
   data position with ``torch.distributed.checkpoint`` (a collective on the
   old group);
3. :func:`dpnb.cluster.world.resize_world` stops the highest ranks' engines
   or starts new ones and forms one group of ``M`` ranks;
4. every rank replays the setup log (the marked cells, the wrap, the data
   choice) and loads the checkpoint: DCP reshards each tensor for the new
   world size (ZeRO-1 and FSDP shards are cut differently on ``M`` ranks);
5. the batch plan is kept for the next ``%dp train`` (global batch kept by a
   new grad-accum), or the learning rate is rescaled on every rank.

Because the data position is counted in global samples, the first step after
the resize reads the same samples one process would read for that step.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import asdict

from ..cluster.world import check_target, resize_world
from ..core.errors import ConfigError
from ..core.resize import ResizePlan, plan_resize
from dpnb.engine import entrypoints as ep
from ..errors import DpnbError
from . import resume
from .results import ResizeResult
from .training_state import BatchPlan

log = logging.getLogger(__name__)



def _check_model(cluster) -> None:
    if not cluster.setup_log.wrapped:
        raise DpnbError("resize moves a training job, and no model was wrapped: %dp wrap one "
                        "first (to change an empty cluster's size, %dp stop and %dp start -n M)")


def plan(cluster, n: int, keep: str = "batch", lr_rule: str = "linear") -> ResizePlan:
    """The batch layout on ``n`` ranks, from the last ``train`` call (or its plan)."""
    st = cluster.training
    last = st.batch_plan or (st.last_train.args if st.last_train else None)
    if not last:
        raise DpnbError("no training step has run yet, so there is no global batch to keep: "
                        "%dp train first, or %dp stop and %dp start -n M")
    try:
        return plan_resize(int(last.micro_batch), int(last.grad_accum),
                           cluster.world_size, n, keep=keep, lr_rule=lr_rule)
    except ConfigError as e:
        raise DpnbError(str(e)) from None


def resize(cluster, n: int, *, keep: str = "batch", lr_rule: str = "linear",
           checkpoint_dir: str | None = None) -> ResizeResult:
    """Move the wrapped model, its optimizer and the data position to ``n`` ranks.

    ``keep="batch"``: the next ``train`` keeps the global batch (grad-accum,
    and micro-batch if needed, re-chosen; see :func:`dpnb.core.resize.plan_resize`).
    ``keep="lr"``: per-rank batch kept, learning rate scaled by the global
    batch's ratio (``lr_rule`` linear or sqrt).  ``checkpoint_dir``: where the
    hand-over checkpoint goes (default: a folder in the cluster's profile on
    one host; give shared storage for a cluster on several hosts).
    """
    cluster.require_running()
    target = check_target(cluster.world, cluster.engine_launcher, cluster.backend,
                          cluster.gpus, n)
    _check_model(cluster)
    rebuild = resume.make_plan(cluster)
    resume.refuse_if_incomplete(cluster, rebuild)  # before any engine starts or stops
    p = plan(cluster, n, keep, lr_rule)
    hosts = {r.host for r in cluster.ranks}
    if checkpoint_dir is None and (len(hosts) > 1 or not cluster.local):
        raise DpnbError("the ranks are on several hosts: give --dir DIR on storage every host "
                        "sees, for the checkpoint that carries the state across")
    if checkpoint_dir is None:
        checkpoint_dir = tempfile.mkdtemp(prefix="resize-", dir=cluster.profile_dir)
    path = os.path.abspath(os.path.expanduser(checkpoint_dir))
    saved = cluster.call(ep.SAVE, path).values[0]
    step = saved.get("step")
    world = resize_world(target, worlds=cluster.worlds, launcher=cluster.engine_launcher,
                         group=cluster.group, gpus=cluster.gpus, adopt=cluster.adopt_ranks)
    loaded = resume.replay_and_load(cluster, path, rebuild, world.added)
    lr = None
    last = cluster.training.last_train
    last_scale = last.args.lr_scale if last else "none"
    if keep == "lr" and last_scale == "none":
        lr = cluster.call(ep.SCALE_LR, p.lr_factor).values[0]["lr"]
    cluster.training.batch_plan = BatchPlan(p.micro_batch, p.grad_accum, p.global_batch)
    cluster.refresh_keep_record()  # a kept cluster's record follows its ranks and the plan
    # train's own --lr-scale rule, when one is set, goes on choosing the rate
    how = p.describe(lr_rule=f"--lr-scale {last_scale}" if keep == "lr" and last_scale != "none"
                     else None, lr_now=lr)
    summary = (f"resized {world.old} -> {world.new} ranks at step {step}: {how}; "
               f"model and optimizer resharded from {path}")
    log.info("%s (%s)", summary, loaded)
    return ResizeResult(summary=summary, step=step, plan=p, checkpoint=path, lr=lr,
                        **asdict(world))

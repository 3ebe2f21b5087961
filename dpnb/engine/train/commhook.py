"""How one DDP gradient bucket is sent: DDP's own averaging all-reduce, or
compressed by one of torch's DDP communication hooks.

Runs on every rank, inside DDP's comm hook (:mod:`dpnb.engine.train.measure`
registers one recording hook per model and hands each bucket to
:meth:`CommHook.send`).  Every rank sends every bucket the same way, so the
ranks still end each step with the same averaged (if compressed) gradient:
replicas stay identical, and ``%dp check`` passes.

* ``none``: ``bucket / world_size``, all-reduced in the gradient's dtype.
* ``fp16`` / ``bf16``: the bucket is cast to 16 bits, divided by the world
  size, all-reduced, and cast back: half the bytes on the wire, rounding
  error in every gradient (bf16 keeps fp32's range with 8 bits of mantissa,
  fp16 more mantissa but overflows past 65,504).
* ``powersgd:R``: each gradient matrix M (n x m) is sent as two rank-R
  factors, P (n x R) and Q (m x R), in two all-reduces; vectors (biases) and
  matrices too small to gain are all-reduced whole.  The error left by the
  approximation is fed back into the next step (error feedback), and the
  first step is a plain all-reduce (DDP rebuilds its buckets after it).

``sent`` is the bytes this rank puts into all-reduces for the bucket: for
PowerSGD, read from torch's own count of the elements it sent
(``PowerSGDState.total_numel_after_compression``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpnb.core.strategies import parse_comm_hook

#: PowerSGD's first compressed step: step 0 runs DDP's construction-time
#: buckets, rebuilt in gradient-ready order before step 1; error feedback
#: needs stable buckets (torch requires > 1 with it)
POWERSGD_START = 2


class CommHook:
    """The sending half of the recording DDP hook, one per wrapped model."""

    def __init__(self, spec: str | None = "none"):
        self.kind, self.rank = parse_comm_hook(spec)
        self.state = None
        if self.kind == "powersgd":
            # lazy: only a --comm-hook loads DDP's hook modules
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

            self.state = ps.PowerSGDState(process_group=None,
                                          matrix_approximation_rank=self.rank,
                                          start_powerSGD_iter=POWERSGD_START)

    def send(self, bucket) -> tuple[torch.futures.Future, int]:
        """Start averaging ``bucket`` over the ranks: (future of the averaged
        flat gradient, bytes this rank sends for it)."""
        buf = bucket.buffer()
        if self.kind == "none":
            group = dist.group.WORLD
            buf.div_(dist.get_world_size(group))
            fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0]), buf.numel() * buf.element_size()
        # lazy: only a --comm-hook loads DDP's hook modules
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.kind in ("fp16", "bf16"):
            hook = (default_hooks.fp16_compress_hook if self.kind == "fp16"
                    else default_hooks.bf16_compress_hook)
            return hook(None, bucket), buf.numel() * 2
        st = self.state
        before, compressing = st.total_numel_after_compression, st.iter >= st.start_powerSGD_iter
        fut = powerSGD_hook.powerSGD_hook(st, bucket)
        sent = st.total_numel_after_compression - before if compressing else buf.numel()
        if compressing and dist.get_backend() == "gloo":
            # PowerSGD's callbacks wait for their next all-reduce inside gloo's
            # completion threads; with two buckets in flight both threads wait
            # and nothing runs the all-reduces (seen here: every rank stuck in
            # unpack_uncompressed_tensors_and_allreduce_ps).  One bucket at a
            # time: no overlap with backward, which PowerSGD is not for.
            fut.wait()
        return fut, sent * buf.element_size()

    def register(self, ddp) -> None:
        """Install as DDP's hook without recording (``record_buckets=False``)."""
        ddp.register_comm_hook(state=self, hook=_plain_hook)


def _plain_hook(hook, bucket):  # no annotations: DDP checks them literally
    return hook.send(bucket)[0]

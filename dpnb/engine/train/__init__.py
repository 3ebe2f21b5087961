"""Data-parallel training on a rank: wrap, data, the step, checkpoints.

Owns the entry points the session calls (``training``), the model's wrap
(DDP, ZeRO-1, FSDP2), the dataset and its micro-batches, a train call's plan
and its step loop (micro-batches, gradient sync, optimizer, the per-step
stats all-gather that carries the stop flags), checkpoints (DCP) and the
exported batch job.  May import every other engine room; the runtime
(``dpnb.cluster``) never imports this room (``tests/unit/test_layers.py``).
"""

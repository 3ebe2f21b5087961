"""What the views measure on the ranks: model-state bytes, DDP buckets,
timing hooks and step records, residency during a step, real collectives
for benchmarks, and ``%%dp --profile``'s profiler.  May import ``train``
(the training state it reads) and the lower rooms; the runtime never
imports it.
"""

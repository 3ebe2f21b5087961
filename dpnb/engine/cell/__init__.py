"""The user's code on a rank: what a ``%%dp`` cell or a script passes through.

Owns the cell guard (every collective a cell calls counted, checked across
ranks over the check star before gloo/NCCL sees it, point-to-point sizes
compared between the two ranks), torchrun's lifecycle calls made safe on a
rank that lives across cells, ``%dp run SCRIPT``, and what a cell's reply says
it published.  May import: ``dpnb.core``, the leaves, ``dpnb.engine.proc``
(the wire, the private folder), ``dpnb.engine.debugging`` (the user's frame),
``dpnb.engine.state`` and ``dpnb.engine.device``.  Nothing of training.
"""

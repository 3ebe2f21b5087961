"""The ``standin`` tier: dpnb's engine code against NCCL's CPU stand-in.

Why a gloo-backed backend registered for ``cuda`` and not torch's fake
backend, and how "CUDA" tensors exist on a CPU-only torch: see
``tests/helpers/standin.py``.  Each test runs its function on real ranks
(``helpers.mp.run_ranks(..., standin=True)``).
"""

"""What the GPU tiers share: the model cell, and save → train → load → train."""

from __future__ import annotations

import pytest

SETUP = """
import dpnb.data
torch.manual_seed(0)
ds = dpnb.data.SyntheticRegression(n=512, in_dim=32, out_dim=4, seed=0)
net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
"""


def assert_resumes_exactly(c, path: str, steps: int = 2) -> None:
    """Save, train ``steps``, load the save, train again: the same losses."""
    c.save(path)
    ref = c.train(steps=steps, micro_batch=16, progress=False)["losses"]
    c.load(path)
    again = c.train(steps=steps, micro_batch=16, progress=False)["losses"]
    assert again == pytest.approx(ref, rel=1e-5, abs=1e-6)

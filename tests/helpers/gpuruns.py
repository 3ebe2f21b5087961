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


def bucket_records_after_training(c) -> list:
    """Wrap with DDP and a 1 KB bucket cap, train 3 steps; each rank's last
    bucket record, checked: several buckets (none forgotten), ordered times."""
    c.run(SETUP, display=False)
    # 1 KB: the 37 KB model then fills two buckets (a cap applies to the first
    # bucket too, and a bucket closes once it reaches the cap)
    c.wrap("net", "ddp", bucket_cap_mb=0.001)
    c.set_data("ds")
    c.train(steps=3, micro_batch=16, progress=False)
    last = []
    for recs in c.call("dpnb.engine.train.training.bucket_records", 1).values:
        assert recs and len(recs[-1]["buckets"]) > 1
        assert all(b["end"] >= b["start"] >= 0 for b in recs[-1]["buckets"])
        last.append(recs[-1])
    return last

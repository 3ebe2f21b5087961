"""The checkpoint folder out of space (issue 59): a clear error, the previous
checkpoint intact and still the latest, no partial folder, training not corrupted.

A real full disk: a 600 KiB tmpfs (root only) that holds two checkpoints of
this model and not a third.
"""

from __future__ import annotations

import os
import subprocess

import pytest

import dpnb
from dpnb.errors import DpnbError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")

SETUP = ("import dpnb.data\ntorch.manual_seed(0)\n"
         "ds = dpnb.data.SyntheticRegression(n=512, in_dim=64, out_dim=1, seed=0)\n"
         "net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), "
         "torch.nn.Linear(256, 1))")


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_checkpoint_folder_is_said_and_nothing_is_lost(small_disk):
    auto = small_disk / "auto"
    with dpnb.start(2) as c:
        c.run(SETUP, display=False, setup=True)
        c.wrap("net", "ddp", optimizer="adam", lr=1e-3)
        c.set_data("ds")
        with pytest.raises(DpnbError) as ei:
            c.train(steps=8, micro_batch=8, progress=False, checkpoint_every=2,
                    checkpoint_dir=str(auto))
        msg = str(ei.value)
        assert "\n" not in msg.strip() and "Traceback" not in msg, msg  # one line, every rank alike
        assert f"checkpoint not written: {auto} is out of space (" in msg, msg
        assert "the partial folder was removed" in msg, msg
        assert "Training stopped after step 5" in msg and \
            "step-00000004 is intact and still the latest" in msg, msg
        assert sorted(os.listdir(auto)) == ["latest", "step-00000002", "step-00000004"]
        assert (auto / "latest").read_text().strip() == "step-00000004"
        # the replicas agree and training goes on from where it stopped
        assert c.check()["ok"]
        s = c.train(steps=2, micro_batch=8, progress=False)
        assert s["first_step"] == 6 and s["loss"] == s["loss"] and abs(s["loss"]) < 1e6
        # %dp save into the full disk: the same sentence, no partial folder left
        with pytest.raises(DpnbError, match="is out of space .*the partial folder was removed"):
            c.save(str(small_disk / "by-hand"))
        assert not (small_disk / "by-hand").exists()
        # the intact checkpoint still loads
        c.load(str(auto / "step-00000004"))
        assert c.check()["ok"]

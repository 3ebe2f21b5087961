"""The view magics wired to dpnb.widgets (terminal mode: text summaries)."""

import pytest
from IPython.core.error import UsageError




def test_model_views_need_no_cluster(ip, capsys, tmp_path):
    ip.run_line_magic("dp", "memory --params 7e9 --dp 8")
    out = capsys.readouterr().out
    assert "112" in out and "14" in out  # 16 B/param unsharded; 16/8 under ZeRO-3 (GB)
    ip.run_line_magic("dp", "batch --micro-batch 2 --dp 16 --grad-accum 4 --seq-len 4096")
    assert "524,288" in capsys.readouterr().out
    ip.run_line_magic("dp", "comm --link ib-hdr-200 --n 8")
    assert capsys.readouterr().out.strip()
    ip.run_line_magic("dp", "scaling --max-dp 64")
    assert capsys.readouterr().out.strip()
    ip.run_line_magic("dp", "ring --n 4")
    assert "reduce-scatter" in capsys.readouterr().out.lower()
    png = tmp_path / "mem.png"
    ip.run_line_magic("dp", f"memory --params 1e9 --dp 4 --save {png}")
    assert png.stat().st_size > 10_000
    with pytest.raises(UsageError):
        ip.run_line_magic("dp", "memory --dp 0")
    with pytest.raises(UsageError, match="png or .svg"):
        ip.run_line_magic("dp", f"memory --save {tmp_path / 'x.jpg'}")
    with pytest.raises(UsageError, match="no dpnb cluster is running"):
        ip.run_line_magic("dp", "memory --live")
    with pytest.raises(UsageError, match="--no-stages goes with --live"):
        ip.run_line_magic("dp", "memory --no-stages")


def test_live_views(ip, capsys):
    ip.run_line_magic("dp", "start -n 2 --timeout 8")
    ip.run_cell_magic("dp", "", "import dpnb.data\ntorch.manual_seed(0)\n"
                      "ds = dpnb.data.SyntheticRegression(n=256, in_dim=16, out_dim=1, seed=0)\n"
                      "net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), "
                      "torch.nn.Linear(64, 1))")
    ip.run_line_magic("dp", "wrap net --strategy ddp --bucket-cap-mb 0.002")
    ip.run_line_magic("dp", "data ds")
    ip.run_line_magic("dp", "train --steps 3 --micro-batch 8")
    capsys.readouterr()
    ip.run_line_magic("dp", "gradsync")
    out = capsys.readouterr().out
    assert "bucket" in out.lower() and "all-reduce" in out.lower()
    ip.run_line_magic("dp", "memory --live")
    out = capsys.readouterr().out
    assert "measured" in out.lower()
    ip.run_line_magic("dp", "memory --live --no-stages")  # the quick start's: ZeRO is not taught yet
    out = capsys.readouterr().out
    assert out.startswith("Memory per rank") and "byte for byte" in out and "ZeRO" not in out, out
    b = ip.run_line_magic("dp", "bench allreduce --sizes 1e3:1e5:3 --iters 2")
    assert b.world_size == 2 and len(b.sizes) == 3
    h = ip.run_line_magic("dp", "bench hierarchical --hosts 2 --sizes 1e4:1e6:2 --iters 1")
    assert (h.hosts, h.per_host, h.equal, h.pretend) == (2, 1, True, True)
    assert "two-level" in capsys.readouterr().out
    with pytest.raises(UsageError, match="one host"):
        ip.run_line_magic("dp", "bench hierarchical")
    ip.run_line_magic("dp", "ring --live --numel 64")
    assert "all_reduce" in capsys.readouterr().out
    ip.run_line_magic("dp", "straggle --rank 1 --delay 50")
    assert "rank 1: 50 ms" in capsys.readouterr().out
    ip.run_line_magic("dp", "train --steps 2 --micro-batch 8")
    ip.run_line_magic("dp", "stragglers")
    assert "rank 1" in capsys.readouterr().out
    ip.run_line_magic("dp", "straggle --clear")
    with pytest.raises(UsageError, match="--rank R --delay MS"):
        ip.run_line_magic("dp", "straggle --rank 1")
    ip.run_line_magic("dp", "dashboard")
    assert capsys.readouterr().out.strip()

    # gradient compression: the wrap says it, the gradsync view shows the bytes sent
    ip.run_line_magic("dp", "wrap net --strategy ddp --bucket-cap-mb 0.002 --comm-hook fp16")
    assert "gradients sent as fp16" in capsys.readouterr().out
    ip.run_line_magic("dp", "train --steps 2 --micro-batch 8")
    capsys.readouterr()
    ip.run_line_magic("dp", "gradsync")
    out = capsys.readouterr().out
    assert "comm hook fp16:" in out and "(50%)" in out and "sent" in out, out
    with pytest.raises(UsageError, match="unknown --comm-hook 'zip'"):
        ip.run_line_magic("dp", "wrap net --comm-hook zip")
    with pytest.raises(UsageError, match="zero2 has none: use --mixed-precision bf16"):
        ip.run_line_magic("dp", "wrap net --strategy zero2 --comm-hook fp16")
    with pytest.raises(UsageError, match="powersgd:0"):
        ip.run_line_magic("dp", "wrap net --comm-hook powersgd:0")

    # memory during the step: each strategy measured is kept, to compare
    ip.run_line_magic("dp", "memory --during")
    out = capsys.readouterr().out
    assert "ddp (ranks 0-1)" in out and "forward: params" in out, out
    ip.run_line_magic("dp", "wrap net --strategy zero3")
    ip.run_line_magic("dp", "memory --during --micro-batch 4")
    out = capsys.readouterr().out
    assert "ddp (ranks 0-1)" in out and "zero3 (ranks 0-1)" in out, out
    with pytest.raises(UsageError, match="--micro-batch must be a whole number >= 1"):
        ip.run_line_magic("dp", "memory --during --micro-batch 0")

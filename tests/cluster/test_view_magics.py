"""The view magics wired to dpnb.widgets (terminal mode: text summaries)."""

import re

import pytest
from IPython.core.error import UsageError




def _row(out: str, *first: str) -> list[str]:
    """The cells of the text table row whose first cells are ``first``."""
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[:len(first)] == list(first):
            return cells
    raise AssertionError(f"no row {first!r} in:\n{out}")


def test_model_views_need_no_cluster(ip, capsys, tmp_path):
    ip.run_line_magic("dp", "memory --params 7e9 --dp 8")
    out = capsys.readouterr().out
    # bf16-mixed Adam: 2 + 2 + 12 B per parameter; ZeRO-3 shards all of it over 8
    assert _row(out, "ZeRO-0 (DDP)")[1] == f"{7e9 * 16 / 1e9:g} GB" == "112 GB"
    assert _row(out, "ZeRO-3")[1] == f"{7e9 * 16 / 8 / 1e9:g} GB" == "14 GB"
    ip.run_line_magic("dp", "batch --micro-batch 2 --dp 16 --grad-accum 4 --seq-len 4096")
    assert f"{2 * 16 * 4 * 4096:,}" in capsys.readouterr().out  # tokens per step
    ip.run_line_magic("dp", "comm --link ib-hdr-200 --n 8")
    # ring all-reduce of 1 GB over 8 ranks at 25 GB/s, 5 us a step: 2(N-1)/N S/B + 2(N-1) a
    ar = (2 * 7 / 8 * 1e9) / 25e9 + 2 * 7 * 5e-6
    rs = (7 / 8 * 1e9) / 25e9 + 7 * 5e-6
    assert _row(capsys.readouterr().out, "1 GB")[1:] == [f"{ar * 1e3:.1f} ms", f"{rs * 1e3:.3g} ms",
                                                         f"{rs * 1e3:.3g} ms"]
    ip.run_line_magic("dp", "scaling --max-dp 64")
    # 200 ms compute, 2 GB all-reduced at 50 GB/s (5 us a step), 60% overlapped
    comm = (2 * 63 / 64 * 2e9) / 50e9 + 2 * 63 * 5e-6
    row = _row(capsys.readouterr().out, "64")
    assert row[:5] == ["64", f"{(0.2 + 0.4 * comm) * 1e3:.4g}", "200", f"{comm * 1e3:.4g}",
                       f"{0.4 * comm * 1e3:.4g}"]
    assert row[-1] == f"{0.2 / (0.2 + 0.4 * comm):.1%}"
    ip.run_line_magic("dp", "ring --n 4")
    assert "reduce-scatter" in capsys.readouterr().out.lower()
    png = tmp_path / "mem.png"
    ip.run_line_magic("dp", f"memory --params 1e9 --dp 4 --save {png}")
    assert png.stat().st_size > 10_000
    # every view saves through the one signature, save(path, cluster, **kw): comm too
    png = tmp_path / "comm.png"
    ip.run_line_magic("dp", f"comm --save {png}")
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
    # every rank's tensors counted: 1,153 fp32 parameters, as many gradients, AdamW's two
    # moments and a 4-byte step per tensor (4 tensors) -- equal to the exact prediction
    total = 1153 * 4 * 4 + 4 * 4
    for r in (0, 1):
        assert _row(out, f"rank {r}", "total")[2:] == [f"{total:,}", f"{total:,}", "0 B"]
    assert "measured == predicted on every rank, byte for byte" in out
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
    capsys.readouterr()
    ip.run_line_magic("dp", "stragglers")
    out = capsys.readouterr().out
    assert "injected delay: rank 1 50 ms" in out
    # the two delayed steps: rank 1 the slowest, each step at least its 50 ms
    for step in (out.strip().splitlines()[-2:]):
        cells = re.split(r"\s{2,}", step.strip())
        assert cells[-1] == "rank 1" and float(cells[-2].split()[0]) >= 50, step
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

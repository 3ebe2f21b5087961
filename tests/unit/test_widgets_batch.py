"""Global batch view: numbers from dpnb.core.batch, the grid, the LR panel, the widget."""

import math

import pytest

from dpnb.core import ConfigError, scale_lr, solve_grad_accum
from dpnb.widgets import batch


def test_data_global_batch_tokens_grad_accum_and_lr():
    d = batch.data(micro_batch=4, dp=8, grad_accum=32, seq_len=4096, target_tokens=4 * 2**20,
                   ref_lr=3e-4, ref_batch=256)
    assert d.global_samples == 4 * 8 * 32 == 1024
    assert d.global_tokens == 1024 * 4096
    assert d.solution.exact and d.solution.grad_accum == 32
    assert d.lr["linear"] == pytest.approx(3e-4 * 4)
    assert d.lr["sqrt"] == pytest.approx(3e-4 * 2)
    assert d.parallelism.describe() == "DP=8 × TP=1 × PP=1 = 8"
    assert d.warnings == ()
    txt = batch.text(d)
    assert "1,024 samples" in txt and "4,194,304 tokens" in txt and "grad_accum = 32" in txt
    assert "linear 0.0012" in txt and "sqrt 0.0006" in txt


def test_factoring_and_inexact_target_warn():
    d = batch.data(micro_batch=3, dp=8, grad_accum=1, seq_len=1000, target_tokens=10**6, tp=8, pp=1, gpus=60)
    sol = solve_grad_accum(3, 8, target_tokens=10**6, seq_len=1000)
    assert not sol.exact and d.solution.grad_accum == sol.grad_accum
    assert any("60 / (8 × 1) = 7.5" in w for w in d.warnings)
    assert any(w == sol.message for w in d.warnings)
    assert "WARNING" in batch.text(d)
    # a GPU count that factors, but to another DP than the slider's
    d2 = batch.data(dp=8, tp=4, pp=2, gpus=128)
    assert any("DP = 128 / (4 × 2) = 16" in w for w in d2.warnings)


def test_figure_grid_cells_and_lr_points():
    d = batch.data(micro_batch=2, dp=4, grad_accum=3, seq_len=1, target_tokens=None, ref_lr=1e-3, ref_batch=8)
    fig = batch.figure(d)
    ax, ax2 = fig.axes[:2]
    cells = [p._dpnb_cell for p in ax.patches if hasattr(p, "_dpnb_cell")]
    assert len(cells) == 4 * 3
    last = [p for p in ax.patches if hasattr(p, "_dpnb_cell") and p._dpnb_cell[1] == 2]
    assert len(last) == 4 and all(p.get_facecolor() != ax.patches[0].get_facecolor() for p in last)
    assert "2 × 4 × 3 = 24 samples" in ax.get_title()
    assert "learning rate" in ax2.get_ylabel() and "samples" in ax2.get_xlabel()
    # the two "this batch" markers sit at the scaled LRs
    ys = sorted(y for line in ax2.lines if line.get_marker() == "s" for y in line.get_ydata())
    assert ys == pytest.approx(sorted([scale_lr(1e-3, 8, 24, "sqrt"), scale_lr(1e-3, 8, 24, "linear")]))


def test_large_grid_draws_first_and_last():
    d = batch.data(dp=64, grad_accum=40, target_tokens=None)
    ax = batch.figure(d).axes[0]
    cells = {p._dpnb_cell for p in ax.patches if hasattr(p, "_dpnb_cell")}
    assert len(cells) == 16 * 16
    assert (63, 39) in cells and (0, 0) in cells
    assert [t.get_text() for t in ax.get_yticklabels()][-1] == "39"


def test_widget_recomputes_and_reports_errors():
    box = batch.view(micro_batch=4, dp=8, grad_accum=1, seq_len=2048, target_tokens=2**20)
    assert box.data.global_samples == 32
    box.controls["grad_accum"].value = 16
    assert box.data.global_samples == 4 * 8 * 16
    assert box.data.solution.grad_accum == 2**20 // (4 * 8 * 2048)
    assert "512 samples" in box.readout.value
    assert box.image.value[:4] == b"\x89PNG"
    box.controls["target_tokens"].value = 0
    assert box.data.solution is None
    with pytest.raises(ConfigError):
        batch.data(micro_batch=0, dp=1)


def test_save_png_and_svg(tmp_path):
    p = batch.save(str(tmp_path / "b.png"), micro_batch=4, dp=8)
    assert open(p, "rb").read(4) == b"\x89PNG"
    s = batch.save(str(tmp_path / "b.svg"), micro_batch=4, dp=8)
    assert "<svg" in open(s).read(2000)
    assert math.isfinite(batch.data().lr["sqrt"])

"""ZeRO memory view: stage bars from dpnb.core, fits readout, measured vs exact."""

import pytest

from dpnb.core import GB, ParamSpec, exact_rank_bytes, max_params_that_fit, zero_memory
from dpnb.ranks import parse_ranks
from dpnb.widgets import memory
from helpers.recorded import SPECS, snapshots32



def snapshots(strategy, optimizer="adamw", extra_grad_rank1=0, phase="after_step"):
    """Plumbing: "measured" snapshots made from the predictor itself, so the view's
    agreement with it is true by construction here.  These tests prove the view
    reads, compares and draws what it is given (and shows a difference when one
    is planted); that real tensors match the prediction is proved on real DDP /
    ZeRO / FSDP2 objects by test_core_exact_memory.py::test_exact_mode_matches_*
    and tests/cluster/test_engine_measure.py."""
    specs = [ParamSpec(n, tuple(s), d, r) for n, s, d, r in SPECS]
    pred = exact_rank_bytes(specs, 2, strategy, optimizer, gradient_as_bucket_view=True)
    return [{"rank": p.rank, "world_size": 2, "strategy": strategy, "optimizer": optimizer, "mixed_precision": "none",
             "gradient_as_bucket_view": True, "specs": SPECS, "n_params": 66, "phase": phase, "step": 3,
             "measured": {"params": p.params,
                          "grads": (p.grad_storage if phase == "after_step" else 0) + (extra_grad_rank1 if p.rank else 0),
                          "optimizer": p.optimizer_state}} for p in pred]


def test_stage_bars_are_the_core_numbers():
    d = memory.data(7e9, 8, "bf16-mixed", "adam", 80.0)
    assert [round(b.total / GB, 2) for b in d.bars] == [112.0, 38.5, 26.25, 14.0]
    for b in d.bars:
        ref = zero_memory(7e9, 8, b.stage, "bf16-mixed", "adam")
        assert b.parts == ref.parts()
        assert b.max_params == max_params_that_fit(80 * GB, 8, b.stage, "bf16-mixed", "adam")
    assert [b.fits for b in d.bars] == [False, True, True, True]
    assert d.bars[0].min_dp is None and "never fit" in d.bars[0].min_dp_note
    txt = memory.text(d)
    assert "NO" in txt and "5 bn" in txt and "112 GB" in txt


def test_figure_bar_heights_and_capacity_line():
    d = memory.data(7e9, 8, "bf16-mixed", "adam", 80.0, strategy="zero1")
    fig = memory.figure(d)
    ax = fig.axes[0]
    # stacked parts: the top of each stack is the total, in GB
    tops = {}
    for rect in ax.patches:
        x = round(rect.get_x() + rect.get_width() / 2)
        tops[x] = max(tops.get(x, 0), rect.get_y() + rect.get_height())
    assert [round(tops[i], 2) for i in range(4)] == [112.0, 38.5, 26.25, 14.0]
    caps = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
    assert caps and caps[0].get_ydata()[0] == pytest.approx(80.0)
    assert "GB = 10⁹ B" in ax.get_ylabel()
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[0].endswith("does not fit") and labels[1].endswith("fits")
    assert [t.get_fontweight() for t in ax.get_xticklabels()][1] == "bold"


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_plumbing_live_agreement_is_read_and_said(strategy):
    lm = memory.live_data(snapshots(strategy))
    assert lm.agrees
    assert all(r.diff == {"params": 0, "grads": 0, "optimizer": 0, "total": 0} for r in lm.ranks)
    d = memory.data(66, 2, "fp32", "adamw", 80.0, live=lm)
    assert "byte for byte" in memory.text(d)


def test_live_difference_is_shown_in_bytes():
    lm = memory.live_data(snapshots("zero3", extra_grad_rank1=28))
    assert not lm.agrees and lm.ranks[1].diff["grads"] == 28 and lm.ranks[1].diff["total"] == 28
    d = memory.data(66, 2, "fp32", "adamw", 80.0, live=lm)
    txt = memory.text(d)
    assert "rank 1 +28 B" in txt and "DIFFER" in txt
    fig = memory.figure(d)
    ax2 = fig.axes[1]
    labels = [t.get_text() for t in ax2.get_xticklabels()]
    assert labels[1].endswith("+28 B") and labels[0].endswith(": 0 B")
    # measured (hatched) bar tops = measured totals, in bytes on this scale
    meas = [r for r in ax2.patches if r.get_hatch()]
    top = max(r.get_y() + r.get_height() for r in meas if r.get_x() > 0.5)
    assert top == pytest.approx(sum(lm.ranks[1].measured.values()))


def test_plumbing_between_steps_predicts_no_gradients():
    lm = memory.live_data(snapshots("ddp", phase="now"))
    assert lm.agrees and all(r.predicted["grads"] == 0 for r in lm.ranks)


def test_widget_controls_and_errors():
    box = memory.view(n_params=1e9, dp=4, capacity_gb=24)
    assert box.data.bars[0].total == pytest.approx(16e9)
    box.controls["dp"].value = 16
    assert box.data.bars[3].total == pytest.approx(1e9)
    assert "Fits?" in box.readout.value
    box.controls["offload"].value = "optimizer+params"
    assert box.data.bars[3].total == pytest.approx(2 * 1e9 / 16)  # only grads stay on device
    with pytest.raises(Exception, match="precision"):
        memory.data(1e9, 2, "fp8", "adam")
    with pytest.raises(memory.C.ViewError, match="no memory snapshots"):
        memory.live_data([])


def test_32_ranks_share_bars_and_name_the_outliers():
    lm = memory.live_data(snapshots32("zero3", leak_rank=7))
    groups = memory.bar_groups(lm)
    labels = [label for label, _ in groups]
    # FSDP pads the 66 parameters' shards: ranks past the data hold padding only
    # (different predicted bytes); the leaking rank 7 gets a pair of its own
    assert "rank 7" in labels and len(groups) < 8, labels
    assert sum(len(parse_ranks(label.split(" ", 1)[1], 32)) for label in labels) == 32
    rows = memory.live_rows(lm)
    assert len(rows) == 4 * len(groups)
    d = memory.data(7e9, 32, live=lm)
    assert "rank 7 +64 B" in memory.text(d)
    fig = memory.figure(d)
    assert len(fig.axes[-1].get_xticklabels()) == len(groups)


def test_live_data_sets_the_model_panel_to_the_wrapped_precision():
    """Given recorded snapshots (no cluster), the model panel still takes the
    wrapped model's precision, not the menu's default (bf16-mixed)."""
    snaps = snapshots32("zero3")
    assert memory.live_data(snaps).precision == "fp32"
    snaps = [dict(s, mixed_precision="bf16") for s in snaps]
    assert memory.live_data(snaps).precision == "bf16-mixed"
    box = memory.view(live=memory.live_data(snapshots32("zero3")))
    assert box.controls["precision"].value == "fp32"
    assert "DP=32, fp32, adamw" in box.text()

"""Per-rank tabs: when they appear, what each tab holds, the plain-text form."""

import pytest

from dpnb.cluster import tabs
from dpnb.cluster.render import render_streams


@pytest.mark.parametrize("texts,want", [
    ({0: "a\n", 1: "a\n"}, False),             # identical: one grouped block
    ({0: "a\n", 1: ""}, False),                # only rank 0 printed: one labelled block
    ({0: "", 1: ""}, False),
    ({0: "a\n", 1: "b\n"}, True),              # ranks differ
    ({0: "x\n" * 41, 1: "x\n" * 41}, True),    # long, even if identical
])
def test_wants_tabs(texts, want):
    assert tabs.wants_tabs(texts) is want


def test_tabs_fold_first_then_one_per_distinct_output():
    texts = {0: "loss 1\n", 1: "loss 2\n", 2: "loss 1\n", 3: ""}
    folded = render_streams(texts, 4)
    items = tabs.tab_items(texts, folded)
    assert [t for t, _ in items] == ["[all 4 ranks]", "ranks 0,2", "rank 1", "rank 3"]
    assert items[0][1] == folded and "[ranks 0,2]\nloss 1" in folded
    assert items[1][1] == "loss 1\n" and items[3][1] == "(printed nothing)"


def test_widget_updates_in_place_and_keeps_the_text_form():
    pytest.importorskip("ipywidgets")
    view = tabs.RankTabs()
    t1 = {0: "step 1\n", 1: "step 1\nslow\n"}
    view.update(t1, render_streams(t1, 2))
    panes = list(view.tab.children)
    assert view.tab.titles == ("[all 2 ranks]", "rank 0", "rank 1")
    assert "slow" in panes[2].value and "slow" not in panes[1].value
    t2 = {0: "step 1\nstep 2\n", 1: "step 1\nslow\nstep 2\n"}
    view.update(t2, render_streams(t2, 2))
    assert list(view.tab.children) == panes  # same widgets, new text: streaming in place
    assert "step 2" in panes[1].value
    b = view.bundle()
    assert "application/vnd.jupyter.widget-view+json" in b
    assert b["text/plain"] == render_streams(t2, 2)
    big = {0: "".join(f"{i}\n" for i in range(5000)), 1: "<b>x</b>\n"}
    view.update(big, render_streams(big, 2))
    assert "(3000 earlier lines not shown)\n3000\n" in view.panes[1].value
    assert "&lt;b&gt;x&lt;/b&gt;" in view.panes[2].value  # printed text, never markup


def test_a_rank_that_is_only_behind_is_not_different_while_running():
    ahead, behind = {0: "tick 0\ntick 1\n", 1: "tick 0\n"}, {0: "tick 0\n", 1: "tick 0\ntick 1\n"}
    assert not tabs.wants_tabs(ahead, running=True) and not tabs.wants_tabs(behind, running=True)
    assert tabs.wants_tabs(ahead)  # at the end, different is different
    assert tabs.wants_tabs({0: "tick 0 on rank 0\n", 1: "tick 0 on rank 1\n"}, running=True)

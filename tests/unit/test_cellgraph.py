"""Which cells resume replays: the last binding of each needed name, what changed
it in place later, what those cells read -- never a shell cell, a failed one or a
rank-selected one."""

from __future__ import annotations

from dpnb.core.cellgraph import HistoryCell as H
from dpnb.core.cellgraph import cell_summary, facts, plan

PROVIDED = frozenset({"torch", "rank", "dist"})


def test_facts_separate_bindings_changes_and_reads():
    f = facts("import torch.nn as nn\nclass Net(nn.Module):\n    def __init__(self, k=WIDTH):\n"
              "        super().__init__()\n        self.l = nn.Linear(HIDDEN, k)\n"
              "    def forward(self, x):\n        return act(self.l(x))\nnet = Net()\n"
              "other.fc = nn.Linear(2, 2)\nfor b in loader:\n    net.to(b)\n")
    assert f.binds == {"nn", "Net", "net", "b"}
    assert f.reads == {"WIDTH", "other", "loader"}  # not self, x, k
    assert f.later == {"HIDDEN", "act"}  # read when Net's methods run
    assert f.touches == {"other"}  # a loop's calls change nothing to rebuild
    assert not f.everywhere and not f.problem
    assert facts("m = DDP(net)").everywhere and facts("dist.all_reduce(t)").everywhere
    assert facts("def f():\n    dist.all_reduce(t)").everywhere is False  # defined, not run
    assert facts("!rm -rf data").problem.startswith("it is not plain Python")
    assert facts("net.requires_grad_(False)").touches == {"net"}


def test_the_last_binding_and_its_inputs_as_of_its_place_in_the_history():
    cells = [H(1, "hidden = 32"), H(2, "hidden = 64"), H(3, "net = torch.nn.Linear(hidden, 1)"),
             H(4, "hidden = 128"), H(5, "import os\nos.remove('x')"), H(6, "!ls"),
             H(7, "net.weight.requires_grad_(False)"), H(8, "net.bias.data += 1"),
             H(9, "ds = make(7)"), H(10, "def make(n):\n    return list(range(n * SCALE))"),
             H(11, "SCALE = 2"), H(12, "ds = make(5)")]
    p = plan(cells, {"net": "the wrap", "ds": "the data"}, PROVIDED)
    # make's body reads SCALE when cell 12 calls it: cell 11, after the def, counts
    assert [r.index for r in p.cells] == [2, 3, 7, 8, 10, 11, 12]
    why = {r.index: r.why for r in p.cells}
    assert why[2] == "binds hidden, needed by cell 3" and why[3] == "binds net, needed by the wrap"
    assert why[7] == why[8] == "binds net, needed by the wrap"  # changed net in place
    assert p.ok and not p.left_out and p.unbound == ()


def test_unreplayable_cells_are_left_out_with_their_reason():
    cells = [H(1, "net = torch.nn.Linear(2, 1)"), H(2, "net.fc = 3", ranks=(0,)),
             H(3, "ds = [1, 2]"), H(4, "ds = load()", ok=False),
             H(5, "x = 1\n!echo hi"), H(6, "y = 2", setup=True)]
    p = plan(cells, {"net": "the wrap", "ds": "the data"}, PROVIDED)
    assert [r.index for r in p.cells] == [1, 6]  # the marked cell is always replayed
    assert dict(p.left_out) == {"net.fc = 3": "it ran on rank 0 only",
                                "ds = load()": "it failed on a rank"}
    (name, why, advice), = p.missing
    assert (name, why) == ("ds", "the data")
    assert advice.startswith("its last binding, cell 4, cannot be replayed (it failed on a rank)")
    p2 = plan(cells, {"model": "the wrap"}, PROVIDED)
    assert p2.missing[0][2].startswith("no cell in the history binds it")


def test_cell_summary_is_one_line():
    assert cell_summary("\n  a = 1\nb = 2\n\n") == "a = 1 (+1 lines)"
    assert cell_summary("") == ""

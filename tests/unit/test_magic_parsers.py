"""Random argument strings to every %dp parser give usage errors only."""

import re
import pytest
from hypothesis import given, settings, strategies as st
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from dpnb.magics import DPMagics, subcommands
from dpnb.magics.cell_cmds import CellCommands
from dpnb.magics.options import parse

SUBCOMMANDS = subcommands()

WORDS = st.sampled_from(["-n", "2", "-1", "0", "--backend", "nccl", "gloo", "x", "--ranks",
                         "1:", "--timeout", "nan", "inf", "--", "-", "'", '"', "--gpus", "0,1",
                         "--steps", "--micro-batch", "--strategy", "zero3", "--lr", "1e-3",
                         "--help", "-h", "=", "--rank", "model", "\\", "%", "--hard"])
ARGS = st.one_of(st.text(max_size=40), st.lists(WORDS, max_size=8).map(" ".join))


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(SUBCOMMANDS)), rest=ARGS)
def test_subcommand_parsers_only_raise_usage_errors(name, rest):
    try:
        parse(SUBCOMMANDS[name], name, rest)
    except UsageError as e:
        assert str(e).strip() and "\n" not in str(e).strip()


@settings(max_examples=200, deadline=None)
@given(rest=ARGS)
def test_cell_parser_only_raises_usage_errors(rest):
    try:
        parse(CellCommands.cell, "(cell)", rest)
    except UsageError:
        pass


@pytest.fixture(scope="module")
def magics():
    return DPMagics(InteractiveShell.instance())


@settings(max_examples=300, deadline=None)
@given(line=ARGS)
def test_dispatch_without_cluster_never_tracebacks(magics, line):
    if line.split()[:1] == ["start"]:
        line = "status " + line  # a valid start would really start engines
    try:
        magics.dp(line)
    except UsageError as e:
        assert "\n" not in str(e).strip()


@settings(max_examples=100, deadline=None)
@given(line=ARGS, cell=st.text(max_size=20))
def test_cell_magic_without_cluster_says_start_first(magics, line, cell):
    with pytest.raises(UsageError) as ei:  # a cell with no cluster never runs quietly
        magics.dp(line, cell)
    msg = str(ei.value)
    assert "%dp start" in msg or "%dp (cell)" in msg or "see %dp?" in msg or \
        "cell is empty" in msg


def test_help_lists_every_subcommand_by_its_usage_line():
    """Each handler's own parser makes its usage line, and ``%dp?`` shows them all."""
    doc = DPMagics.dp.__doc__
    for name, handler in SUBCOMMANDS.items():
        assert handler.parser.prog == f"dp {name}"
        assert re.search(rf"^  %dp {re.escape(name)}( |$)", doc, re.M), name
    assert "\n  %%dp [-r RANKS] [--timeout TIMEOUT] [--unchecked]" in doc  # the cell's


def test_every_subcommand_is_a_bound_method_of_the_magics(magics):
    assert set(magics.subcommands) == set(SUBCOMMANDS)
    assert all(m.__self__ is magics for m in magics.subcommands.values())

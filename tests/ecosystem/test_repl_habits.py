"""What people do at a REPL all day -- breakpoint(), exit(), sys.exit(), a
tqdm.auto bar -- costs no engine and leaves nothing wedged.  (A breakpoint
nobody can answer is tested where that happens, in a kernel run without stdin:
tests/cluster/test_kernel.py; every rank dying in tests/cluster/test_mistakes.py.)"""

from __future__ import annotations

import pytest
from helpers.shell import magics_on

from dpnb.errors import RemoteCellError


def test_breakpoint_on_a_rank_prompts_in_the_notebook(c, capsys):
    from dpnb.cluster.debugging import scripted

    pids = [r.pid for r in c.ranks]
    c.transport.ask = scripted(["p x * 10", "x = -1", "n", "p y", "c"])
    try:
        res = c.run("x = rank + 4\nif rank == 1:\n    breakpoint()\ny = x * 2\nz = y + 1\n",
                    display=False)
    finally:
        del c.transport.ask  # back to the class's: input()
    assert res.ok
    out = capsys.readouterr().out
    assert "dpnb: rank 1 stopped in pdb; commands go to rank 1" in out
    assert "(Pdb rank 1) p x * 10\n50" in out  # evaluated on rank 1, in the cell's frame
    assert "-> y = x * 2" in out and "-> z = y + 1" in out  # `next` stepped the cell
    assert "(Pdb rank 1) p y\n-2" in out
    assert c.pull("y") == [8, -2]  # the assignment typed at the prompt took effect
    assert [r.pid for r in c.ranks] == pids


def test_where_starts_at_the_cell_and_names_it_as_dpnb_does(c, capsys):
    """``where`` lists the user's frames only -- the ~40 of the engine's machinery
    (ipyparallel, ipykernel, tornado, asyncio, IPython) below the cell used to
    come first -- and a cell is ``cell line N``, not ipykernel's temporary
    file; ``up`` stops at the cell."""
    from dpnb.cluster.debugging import scripted

    c.transport.ask = scripted(["where", "up", "up", "c"])
    try:
        res = c.run("def inner(v):\n    breakpoint()\n    return v\nw = inner(rank) if rank == 1 else 0\n",
                    display=False)
    finally:
        del c.transport.ask
    assert res.ok
    out = capsys.readouterr().out
    where = out.split("(Pdb rank 1) where\n", 1)[1].split("(Pdb rank 1)", 1)[0]
    entries = [ln for ln in where.splitlines() if ln[:2] in ("  ", "> ") and not ln.startswith("  ->")]
    assert entries == ["  cell line 4, in <module>()", "> cell line 3, in inner()"], where
    for machinery in ("ipykernel", "tornado", "asyncio", "IPython", "ipyparallel", "dpnb/"):
        assert machinery not in where, where
    # the first `up` goes to the cell's line 4; the second finds no older frame
    after_up = out.split("(Pdb rank 1) up\n", 1)[1]
    assert after_up.startswith("> cell line 4, in <module>()"), after_up
    assert "(Pdb rank 1) up\n*** Oldest frame" in out, out


def test_pdb_set_trace_and_torch_distributed_breakpoint_prompt_too(c, capsys):
    from dpnb.cluster.debugging import scripted

    c.transport.ask = scripted(["p rank", "c", "p rank", "c"])
    try:
        res = c.run("import pdb\nif rank == 0:\n    pdb.set_trace()\n"
                    "dist.breakpoint(rank=1)\ndone = rank", display=False)
    finally:
        del c.transport.ask
    assert res.ok and c.pull("done") == [0, 1]
    out = capsys.readouterr().out
    # pdb.set_trace stopped rank 0; torch's breakpoint(rank=1) stopped rank 1 only
    assert "(Pdb rank 0) p rank\n0" in out and "(Pdb rank 1) p rank\n1" in out, out


def test_exit_and_sys_exit_end_the_cell_not_the_engine(c):
    pids = [r.pid for r in c.ranks]
    for code, said in (("exit()", "exit() / sys.exit()"), ("quit(3)", "sys.exit(3)"),
                       ("import sys\nsys.exit(2)", "sys.exit(2)")):
        with pytest.raises(RemoteCellError) as ei:
            c.run(code, display=False)
        assert "ranks 0-1: exit() / sys.exit(" in ei.value.report and said.split()[-1] \
            in ei.value.report, ei.value.report
    # what used to kill both engines: exit(), then an error in the next cell
    with pytest.raises(RemoteCellError) as ei:
        c.run("raise ValueError('next')", display=False)
    assert ei.value.summary == "ranks 0-1 raised ValueError"
    assert c.run("alive = True", display=False).ok and c.pull("alive") == [True, True]
    assert [r.pid for r in c.ranks] == pids and not c.dead


def test_tqdm_auto_on_the_ranks_is_text_in_a_terminal_and_breaks_nothing(c, capsys):
    with magics_on(c) as ip:
        ip.run_cell_magic("dp", "", "from tqdm.auto import tqdm\nfor i in tqdm(range(3)):\n"
                                    "    pass\nbar = type(tqdm).__module__")
        ip.run_cell_magic("dp", "", "print('the next cell prints')")
    out = capsys.readouterr()
    assert "the next cell prints" in out.out and "AttributeError" not in out.err
    assert "3/3" in out.out + out.err
    assert c.pull("bar")[0] != "tqdm.notebook"

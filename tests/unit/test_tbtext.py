"""A failed cell's traceback written on the rank (dpnb.engine.debugging.tbtext): the
text IPython's Context mode writes, without its module scans."""

from __future__ import annotations

import inspect
import linecache
import re
import sys

from IPython.core.ultratb import FormattedTB

from dpnb.cluster.diagnose import user_line
from dpnb.engine.debugging import tbtext

SRC = "def inner(a, b=2):\n    x = 1\n    return x / 0\nx = 1\ny = 2\ninner(x)\nz = 3\n"
#: IPython's own text differs here (its chained frame shows the line the frame
#: is at, 6, not the one that raised, 3), so this one is checked by its marks
CHAINED = "try:\n    {}['k']\nexcept KeyError as e:\n    raise RuntimeError('wrapped') from e\n"


def _raised(src: str, name: str = "/tmp/dpnb_tbtext_cell.py"):
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    try:
        exec(compile(src, name, "exec"), {"__name__": "__main__"})
    except Exception:
        return sys.exc_info()
    raise AssertionError("did not raise")


def _marks(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.match(r"(File |Cell |-+> |\w+Error|-{75})", ln)]


def test_the_text_is_ipython_s_context_layout_without_colours():
    etype, evalue, tb = _raised(SRC)
    ipython = FormattedTB(mode="Context", theme_name="nocolor")
    want = ipython.stb2text(ipython.structured_traceback(etype, evalue, tb))
    got = ipython.stb2text(tbtext.structured(etype, evalue, tb))
    # the lines the notebook reads and the user looks for: header, each frame's
    # place and function, the arrowed line, the message (the context lines
    # around the arrow may differ: IPython counts statements, this lines)
    assert _marks(got) == _marks(want), f"dpnb:\n{got}\nIPython:\n{want}"
    assert len(_marks(got)) == 9
    assert "\x1b[" not in got
    assert user_line(got) == "/tmp/dpnb_tbtext_cell.py line 3: return x / 0"


def test_chained_exceptions_earliest_first():
    got = "".join(tbtext.structured(*_raised(CHAINED)))
    first, cause, last = (got.index("KeyError: 'k'"), got.index("direct cause"),
                          got.index("RuntimeError: wrapped"))
    assert first < cause < last and "---> 2     {}['k']" in got and "---> 4     raise" in got, got


def test_no_module_is_looked_up(monkeypatch):
    """IPython asks inspect.getmodule for every frame: a scan of sys.modules."""
    def scan(*a, **k):
        raise AssertionError("inspect.getmodule called")

    monkeypatch.setattr(inspect, "getmodule", scan)
    etype, evalue, tb = _raised(SRC)
    assert tbtext.structured(etype, evalue, tb)[-1] == "ZeroDivisionError: division by zero"


class _Shell:
    def __init__(self, mode: str):
        self.InteractiveTB = FormattedTB(mode=mode, theme_name="linux")


def test_installed_for_context_mode_only():
    etype, evalue, tb = _raised(SRC)
    ctx, verbose = _Shell("Context"), _Shell("Verbose")
    assert tbtext.install(ctx) and not tbtext.install(ctx)  # once per shell
    assert "\x1b[" not in "".join(ctx.InteractiveTB.structured_traceback(etype, evalue, tb))
    tbtext.install(verbose)
    verbose.InteractiveTB.mode = "Verbose"  # the user's %xmode keeps IPython's formatter
    assert "\x1b[" in "".join(verbose.InteractiveTB.structured_traceback(etype, evalue, tb))
    tbtext.uninstall(ctx)
    assert "\x1b[" in "".join(ctx.InteractiveTB.structured_traceback(etype, evalue, tb))



def _wrapper_in(module: str):
    """A function defined in ``module`` that hides its frame and raises, as dpnb's
    adopting ``init_process_group`` does for torch's refusals."""
    ns = {"__name__": module}
    exec("def init_process_group(device_id=None):\n"
         "    __tracebackhide__ = True\n"
         "    raise ValueError('init_process_group device_id parameter must be an accelerator')\n",
         ns)
    return ns["init_process_group"]


def test_a_refusal_dpnb_raises_for_torch_ends_at_the_users_line():
    name = "/tmp/dpnb_tbtext_refusal.py"
    src = "x = 1\ninit_process_group(device_id='cpu')\n"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    for module, shown in (("dpnb.engine.group.lifecycle", False), ("somelib.api", True)):
        try:
            exec(compile(src, name, "exec"), {"__name__": "__main__",
                                              "init_process_group": _wrapper_in(module)})
        except ValueError:
            got = "".join(tbtext.structured(*sys.exc_info()))
        assert "---> 2 init_process_group(device_id='cpu')" in got, got
        # dpnb's own raising frame is left out; another library's stays, as IPython keeps it
        assert ("in init_process_group(device_id)" in got) is shown, got
        assert user_line(got) == f"{name} line 2: init_process_group(device_id='cpu')"

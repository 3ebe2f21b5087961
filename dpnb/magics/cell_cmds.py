"""%dp subcommands: values in and out of the ranks, and the setup log.

Each handler carries its parser and help (see :mod:`.options`).
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from ..core.cellflags import profile_flag
from . import debugger
from ..session.resume import describe as describe_resume
from .options import profile_options, run_options, subcommand


class CellCommands:
    """Mixed into :class:`dpnb.magics.DPMagics` (``self._need()``, ``self.shell``)."""

    @subcommand("(cell)", prog="%dp")
    @magic_arguments()
    @run_options("the cell")
    @argument("--no-stream", action="store_true",
              help="do not stream output while the cell runs")
    @argument("--setup", action="store_true",
              help="record this cell (once it succeeds on every rank) for restart --resume")
    @profile_options("the cell")
    def cell(self, a, code: str):
        """%%dp [--ranks SPEC] [--timeout S] [--setup] [--unchecked] [--profile]: run the cell on the selected ranks."""
        c = self._need()
        if not code.strip():
            raise UsageError("%%dp cell is empty: put code to run on the ranks below %%dp")
        dap = debugger.cell_flag(self.dap, self.shell)  # JupyterLab's debugger is on

        def run(tag=None):
            flags = ((profile_flag(tag),) if tag else ()) + ((dap,) if dap else ())
            return c.run(code, ranks=a.ranks, timeout=a.timeout, stream=not a.no_stream,
                         setup=a.setup, unchecked=a.unchecked, flags=flags)

        with debugger.debugged(self.dap, c, a.ranks, dap):
            self._profiled(a, "cell", run, tagged=run)

    @subcommand("push")
    @magic_arguments()
    @argument("names", nargs="+", help="notebook variables to copy to the ranks")
    @argument("--ranks", default=None, help="ranks to push to (default all)")
    def push(self, a):
        """Copy notebook variables into the ranks' namespaces."""
        c = self._need()
        ns = self.shell.user_ns
        missing = [n for n in a.names if n not in ns]
        if missing:
            raise UsageError(f"not defined in the notebook: {', '.join(missing)}")
        c.push({n: ns[n] for n in a.names}, ranks=a.ranks)

    @subcommand("pull")
    @magic_arguments()
    @argument("name", help="variable to fetch from the ranks")
    @argument("--rank", type=int, default=None,
              help="fetch from this rank only (default: a list with one value per rank)")
    def pull(self, a):
        """Fetch a variable from the ranks (one value per rank, or --rank R)."""
        return self._need().pull(a.name, rank=a.rank)

    @subcommand("setup")
    @magic_arguments()
    @argument("--clear", action="store_true", help="forget every recorded setup step")
    def setup(self, a):
        """What restart --resume would replay now: the cells that built the model and data
        (marked --setup or found in the history), then the wrap and data calls."""
        c = self._need()
        if a.clear:
            c.setup_log.clear()
            print("dpnb: setup log cleared; restart --resume will replay nothing")
            return
        lines = describe_resume(c) if c.setup_log.wrapped else []
        print("dpnb: restart --resume would replay, in order:\n  " + "\n  ".join(lines) if lines
              else "dpnb: nothing to replay yet: %dp wrap a model first (the cells that built "
                   "it are then found in this session's history)")

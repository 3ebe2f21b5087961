"""The ``%dp`` line magic and ``%%dp`` cell magic.

They only parse arguments (IPython ``magic_arguments``) and delegate to the
Python API in :mod:`dpnb.session` (the runtime :mod:`dpnb.cluster` under it,
and the view layers); anything a magic does can be done from a script with
``dpnb.start(...)``.  The subcommands live by area, each handler with its
parser on it: :mod:`.cluster_cmds` (start, stop, attach, status, restart,
...), :mod:`.cell_cmds` (``%%dp``, push, pull, setup), :mod:`.train_cmds`
(wrap, data, train, resize, checkpoints), :mod:`.view_cmds` (the views) and
:mod:`.job_cmds` (``%dp run`` a script, ``%dp export`` a job); shared options
and the parsing rules are in :mod:`.options`.
"""

from __future__ import annotations

import logging
import shlex
import textwrap

from IPython import get_ipython
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from .. import session
from ..cluster import launch, zygote
from ..core.errors import UserError
from ..errors import RemoteCellError
from .agent_cmds import AgentCommands
from .cell_cmds import CellCommands
from .cluster_cmds import ClusterCommands
from . import debugger
from .grade_cmds import GradeCommands
from .job_cmds import JobCommands
from .options import handlers, parse
from .train_cmds import TrainingCommands
from .view_cmds import ViewCommands

log = logging.getLogger(__name__)

#: the areas, in the order ``%dp?`` lists their subcommands
AREAS = (ClusterCommands, CellCommands, TrainingCommands, ViewCommands, JobCommands,
         GradeCommands, AgentCommands)


def subcommands() -> dict[str, object]:
    """``name -> handler`` of every ``%dp`` subcommand (the parser is ``handler.parser``)."""
    return handlers(*AREAS)


def _help_text() -> str:
    parts = [
        "dpnb: data-parallel PyTorch from a notebook.",
        "",
        "  %dp start -n 2             start 2 engines in one process group",
        "  %%dp [--ranks 0,2]         run a cell on every (or the selected) rank",
        "  %dp status | stop | restart | push NAME... | pull NAME [--rank R]",
        "",
        "Every engine has rank, world_size, local_rank, device, torch and dist",
        "in its namespace.  Subcommands:",
        "",
    ]
    for f in subcommands().values():
        parts.append(textwrap.dedent(f.__doc__ or "").strip())
        parts.append("")
    parts.append(textwrap.dedent(CellCommands.cell.__doc__ or "").strip())
    return "\n".join(parts)


@magics_class
class DPMagics(Magics, *AREAS):
    """Holds this IPython session's cluster (there is no global one)."""

    def __init__(self, shell=None):
        super().__init__(shell)
        self.cluster: session.Cluster | None = None
        self.live_dashboard = None  # the live dashboard widget, if one is shown
        self.warm = None  # the zygote template that forks each local start's agent (zygote.WarmZygote)
        # JupyterLab's debugger across the ranks (None outside a kernel)
        self.dap = debugger.install(shell, lambda: self.cluster) if shell is not None else None
        self.subcommands = {name: getattr(self, f.__name__) for name, f in subcommands().items()}

    def prewarm(self) -> None:
        """Start the zygote template now, so local ``%dp start`` skips torch's
        import; one is kept for the kernel's life, replaced when it cannot serve
        (it ended, or a variable torch reads at import changed)."""
        if self.warm is not None and not self.warm.usable():
            self.drop_warm()
        if self.warm is None and launch.prewarm_wanted():
            try:
                self.warm = zygote.WarmZygote()
            except OSError as e:  # the start then imports torch itself, as without
                log.warning("could not start a warm zygote: %s", e)

    def show_agent_actions(self, result=None) -> None:
        """After each cell: one line per action an agent took on this cluster since the
        last cell (IPython's post_run_cell: printed in the cell's own output)."""
        c = self.cluster
        door = getattr(c, "agent_door", None) if c is not None else None
        if door is not None:
            for line in door.service.unshown_lines():
                print(line)

    def drop_warm(self) -> None:
        if self.warm is not None:
            self.warm.close()
            self.warm = None

    # -------------------------------------------------------- entry point
    @line_cell_magic
    def dp(self, line: str = "", cell: str | None = None):
        try:
            if cell is not None:
                return self.cell(parse(self.cell, "(cell)", line), cell)
            return self._dispatch(line)
        except RemoteCellError:
            raise  # IPython shows its report via _render_traceback_
        except UserError as e:
            # bad input, wherever dpnb raised it (DpnbError, ViewError, ConfigError ...):
            # told in one line; any other error keeps its traceback
            raise UsageError(str(e)) from None

    dp.__doc__ = _help_text()

    def _dispatch(self, line: str):
        try:
            words = shlex.split(line)
        except ValueError as e:
            raise UsageError(f"%dp: cannot parse {line!r} ({e}); see %dp?") from None
        names = ", ".join(self.subcommands)
        if not words:
            raise UsageError(f"%dp needs a subcommand: {names} (see %dp?)")
        name, rest = words[0], line.split(None, 1)[1] if len(line.split(None, 1)) > 1 else ""
        handler = self.subcommands.get(name)
        if handler is None:
            raise UsageError(f"unknown %dp subcommand {name!r}: use one of {names} (see %dp?)")
        return handler(parse(handler, name, rest))

    def _need(self) -> session.Cluster:
        if self.cluster is None or not self.cluster.running:
            raise UsageError("no dpnb cluster is running: start one with %dp start -n 2")
        return self.cluster

    def _profiled(self, a, what: str, run, tagged=None):
        """``run()``, under torch.profiler on the ranks when ``--profile`` was given; the
        profile is shown even when ``run`` fails (before its error).  ``tagged``: a
        cell's ``run(tag)`` whose request starts the profilers (no call before it)."""
        if a.profile_dir and not a.profile:
            raise UsageError("--profile-dir goes with --profile")
        if not a.profile:
            return run()
        c = self._need()
        try:
            return c.profiled(tagged or run, ranks=getattr(a, "ranks", None), what=what,
                              out_dir=a.profile_dir, in_request=tagged is not None)
        finally:
            if c.last_profile is not None:
                self._show("profile", a, c, {})


def load(ip) -> DPMagics:
    m = DPMagics(ip)
    ip.register_magics(m)
    ip.events.register("post_run_cell", m.show_agent_actions)
    m.prewarm()
    return m


def get_magics(ip=None) -> DPMagics | None:
    if ip is None:
        ip = get_ipython()
    if ip is None:
        return None
    return ip.magics_manager.registry.get("DPMagics")

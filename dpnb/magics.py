"""The ``%dp`` line magic and ``%%dp`` cell magic.

They only parse arguments (IPython ``magic_arguments``) and delegate to the
Python API in :mod:`dpnb.cluster` (and the training/view layers); anything a
magic does can be done from a script with ``dpnb.start(...)``.
"""

from __future__ import annotations

import shlex
import sys
import textwrap

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import cluster as cl
from .errors import DpnbError, RemoteCellError

_SUBCOMMANDS: dict[str, object] = {}


def _sub(name: str):
    def deco(f):
        _SUBCOMMANDS[name] = f
        f.__name__ = f"%dp {name}"
        return f

    return deco


# Each stub carries one subcommand's parser (magic_arguments keeps it on the
# function); the stubs are never called.

@_sub("start")
@magic_arguments()
@argument("-n", type=int, default=2, help="number of engines (ranks), default 2")
@argument("--backend", default="auto", choices=cl.BACKENDS,
          help="auto: nccl when every engine has its own GPU, else gloo")
@argument("--engines", default="local", choices=cl.LAUNCHERS,
          help="ipyparallel launcher for the engines (default local)")
@argument("--gpus", default=None, help="GPU ordinals to use per host, e.g. 0,1,2,3")
@argument("--timeout", type=float, default=cl.DEFAULT_TIMEOUT_S,
          help="process-group timeout in seconds: how long a collective waits for a "
               "peer before it errors (default %(default)s)")
@argument("--threads", type=int, default=None,
          help="torch threads per engine (default: cores / engines per host)")
@argument("--launcher-arg", action="append", default=None, dest="launcher_args",
          help="extra argument for the launcher (repeatable): mpiexec options for mpi, "
               "sbatch options for slurm, HOST=N for ssh")
def _start():
    """Start N engines and join them in one torch.distributed process group."""


@_sub("stop")
@magic_arguments()
def _stop():
    """Stop every process dpnb started (controller, engines)."""


@_sub("status")
@magic_arguments()
def _status():
    """Table of ranks: host, pid, device, backend, alive, memory in use."""


@_sub("restart")
@magic_arguments()
@argument("--hard", action="store_true", help="replace every engine (all state is lost)")
def _restart():
    """Replace dead engines and re-form the process group; says what was lost."""


@_sub("reform")
@magic_arguments()
def _reform():
    """Destroy and re-create the process group on a fresh port (state kept)."""


@_sub("interrupt")
@magic_arguments()
@argument("--ranks", default=None, help="ranks to interrupt (default all)")
def _interrupt():
    """Send SIGINT (KeyboardInterrupt) to the engines of the selected ranks."""


@_sub("push")
@magic_arguments()
@argument("names", nargs="+", help="notebook variables to copy to the ranks")
@argument("--ranks", default=None, help="ranks to push to (default all)")
def _push():
    """Copy notebook variables into the ranks' namespaces."""


@_sub("pull")
@magic_arguments()
@argument("name", help="variable to fetch from the ranks")
@argument("--rank", type=int, default=None,
          help="fetch from this rank only (default: a list with one value per rank)")
def _pull():
    """Fetch a variable from the ranks (one value per rank, or --rank R)."""


@magic_arguments()
@argument("--ranks", default=None,
          help="ranks to run on: 0 | 0,2 | 1: | :2 | 0-2 | all (default all)")
@argument("--timeout", type=float, default=None,
          help="wall-clock limit for the cell in seconds; ranks still running are "
               "interrupted and reported")
@argument("--no-stream", action="store_true",
          help="do not stream output while the cell runs")
def _cell():
    """%%dp [--ranks SPEC] [--timeout S]: run the cell on the selected ranks."""


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
    for name, f in _SUBCOMMANDS.items():
        parts.append(textwrap.dedent(f.__doc__ or "").strip())
        parts.append("")
    parts.append(textwrap.dedent(_cell.__doc__ or "").strip())
    return "\n".join(parts)


def _parse(stub, name: str, rest: str):
    try:
        return parse_argstring(stub, rest)
    except UsageError as e:
        raise UsageError(f"%dp {name}: {e}. See %dp? for usage.") from None
    except SystemExit:  # argparse on --help inside the magic parser
        raise UsageError(f"see %dp? for usage of %dp {name}") from None
    except ValueError as e:  # shlex: unbalanced quotes
        raise UsageError(f"%dp {name}: cannot parse arguments ({e}).") from None


@magics_class
class DPMagics(Magics):
    """Holds this IPython session's cluster (there is no global one)."""

    def __init__(self, shell=None):
        super().__init__(shell)
        self.cluster: cl.Cluster | None = None

    # -------------------------------------------------------- entry point
    @line_cell_magic
    def dp(self, line: str = "", cell: str | None = None):
        try:
            if cell is not None:
                return self._run_cell(line, cell)
            return self._dispatch(line)
        except RemoteCellError:
            raise  # IPython shows its report via _render_traceback_
        except DpnbError as e:
            raise UsageError(str(e)) from None

    dp.__doc__ = _help_text()

    def _dispatch(self, line: str):
        try:
            words = shlex.split(line)
        except ValueError as e:
            raise UsageError(f"%dp: cannot parse {line!r} ({e}); see %dp?") from None
        if not words:
            raise UsageError("%dp needs a subcommand: " + ", ".join(_SUBCOMMANDS) + " (see %dp?)")
        name, rest = words[0], line.split(None, 1)[1] if len(line.split(None, 1)) > 1 else ""
        stub = _SUBCOMMANDS.get(name)
        if stub is None:
            raise UsageError(f"unknown %dp subcommand {name!r}: use one of "
                             + ", ".join(_SUBCOMMANDS) + " (see %dp?)")
        args = _parse(stub, name, rest)
        return getattr(self, "_do_" + name.replace("-", "_"))(args)

    def _need(self) -> cl.Cluster:
        if self.cluster is None or not self.cluster.running:
            raise UsageError("no dpnb cluster is running: start one with %dp start -n 2")
        return self.cluster

    # -------------------------------------------------------- subcommands
    def _run_cell(self, line: str, cell: str):
        args = _parse(_cell, "(cell)", line)
        c = self._need()
        if not cell.strip():
            raise UsageError("%%dp cell is empty: put code to run on the ranks below %%dp")
        c.run(cell, ranks=args.ranks, timeout=args.timeout, stream=not args.no_stream)

    def _do_start(self, a):
        if self.cluster is not None and self.cluster.running:
            c = self.cluster
            raise UsageError(f"a dpnb cluster is already running ({c.world_size} ranks, "
                             f"{c.backend}): %dp stop it first, or %dp restart")
        c = cl.Cluster.start(a.n, backend=a.backend, engines=a.engines, gpus=a.gpus,
                             timeout=a.timeout, threads=a.threads,
                             launcher_args=a.launcher_args)
        self.cluster = c
        devs = sorted({r.device for r in c.ranks})
        hosts = sorted({r.host for r in c.ranks})
        print(f"dpnb: {c.world_size} ranks up ({c.backend}, {', '.join(devs)}, "
              f"{len(hosts)} host{'s' if len(hosts) > 1 else ''}, group timeout "
              f"{c.timeout_s:g} s). Use %%dp to run cells on them.")

    def _do_stop(self, a):
        c = self._need()
        pids = c.stop()
        print(f"dpnb: cluster stopped ({len(pids)} processes).")

    def _do_status(self, a):
        from .display import show_status

        show_status(self._need().status())

    def _do_restart(self, a):
        print("dpnb: " + self._need().restart(hard=a.hard))

    def _do_reform(self, a):
        info = self._need().reform()
        print(f"dpnb: process group re-formed on port {info['port']} "
              f"(generation {info['generation']}).")

    def _do_interrupt(self, a):
        self._need().interrupt(a.ranks)

    def _do_push(self, a):
        c = self._need()
        ns = self.shell.user_ns
        missing = [n for n in a.names if n not in ns]
        if missing:
            raise UsageError(f"not defined in the notebook: {', '.join(missing)}")
        c.push({n: ns[n] for n in a.names}, ranks=a.ranks)

    def _do_pull(self, a):
        return self._need().pull(a.name, rank=a.rank)


def load(ip) -> DPMagics:
    m = DPMagics(ip)
    ip.register_magics(m)
    return m


def get_magics(ip=None) -> DPMagics | None:
    if ip is None:
        from IPython import get_ipython

        ip = get_ipython()
    if ip is None:
        return None
    return ip.magics_manager.registry.get("DPMagics")

"""How a ``%dp`` subcommand is declared and parsed, and the options several share.

A subcommand is a method of one of the areas' classes (``*_cmds.py``) with
IPython's ``magic_arguments`` decorators on it, as ipyparallel writes its
magics, and :func:`subcommand` on top, which names it and makes its parser's
usage line read ``%dp NAME``.  :class:`dpnb.magics.DPMagics` collects the
methods so named; nothing is looked up by building a string.
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, parse_argstring

#: the attribute :func:`subcommand` sets on a handler: its ``%dp`` name
NAME_ATTR = "dp_subcommand"


def subcommand(name: str, prog: str | None = None):
    """Mark a handler as ``%dp NAME`` (``prog``: another usage line, for ``%%dp``)."""

    def deco(f):
        f.parser.prog = prog or f"dp {name}"  # IPython prefixes the usage with %
        f.__doc__ = f.parser.format_help()
        setattr(f, NAME_ATTR, name)
        return f

    return deco


def handlers(*areas: type) -> dict[str, object]:
    """``name -> handler function`` for every subcommand of ``areas``, in their order."""
    out: dict[str, object] = {}
    for area in areas:
        for f in vars(area).values():
            name = getattr(f, NAME_ATTR, None)
            if name is not None and name != "(cell)":
                out[name] = f
    return out


def parse(handler, name: str, rest: str):
    """``rest`` parsed by ``handler``'s parser; every failure is a one-line UsageError."""
    try:
        return parse_argstring(handler, rest)
    except UsageError as e:
        raise UsageError(f"%dp {name}: {e}. See %dp? for usage.") from None
    except SystemExit:  # argparse on --help inside the magic parser
        raise UsageError(f"see %dp? for usage of %dp {name}") from None
    except ValueError as e:  # shlex: unbalanced quotes
        raise UsageError(f"%dp {name}: cannot parse arguments ({e}).") from None


#: every view's --save (the file's suffix picks the format)
save_option = argument("--save", default=None, metavar="PATH",
                       help="write the figure to PATH (.png/.svg) instead of showing it")


def _group(decos: list):
    """One decorator applying ``decos`` in the order written (an option group)."""
    def apply(f):
        for d in reversed(decos):
            f = d(f)
        return f

    return apply


def run_options(what: str):
    """The options of code run on the ranks (``%%dp`` and ``%dp run``): where, how
    long, and whether its collectives are checked across ranks first."""
    decos = [
        argument("-r", "--ranks", default=None,
                 help=f"ranks to run {what} on: 0 | 0,2 | 1: | :2 | 0-2 | all (default all)"),
        argument("--timeout", type=float, default=None,
                 help=f"wall-clock limit for {what} in seconds; ranks still running are "
                      f"interrupted and reported"),
        argument("--unchecked", action="store_true",
                 help=f"do not check the collectives of {what} across ranks first (hot "
                      f"hand-written loops; a mismatch may then abort gloo)"),
    ]
    return _group(decos)


def profile_options(what: str):
    """``--profile`` / ``--profile-dir``: run ``what`` with torch.profiler on every rank."""
    decos = [
        argument("--profile", action="store_true",
                 help=f"run {what} with torch.profiler on every rank and show where each rank's "
                      f"time went (again later: %%dp profile)"),
        argument("--profile-dir", default=None, metavar="DIR",
                 help="with --profile: the folder for the traces (default dpnb-profiles/<time>)"),
    ]
    return _group(decos)

"""%dp subcommands: code from elsewhere in, and the session out: a torchrun script, a batch job.

Each handler carries its parser and help (see :mod:`.options`).
"""

from __future__ import annotations

import argparse

from IPython.core.magic_arguments import argument, magic_arguments

from .options import profile_options, run_options, subcommand


class JobCommands:
    """Mixed into :class:`dpnb.magics.DPMagics` (``self._need()``, ``self.shell``)."""

    @subcommand("run")
    @magic_arguments()
    @run_options("the script")
    @argument("script", help="the Python script, as you would give it to torchrun")
    @profile_options("the script")
    @argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    def run(self, a):
        """Run a torchrun script on every rank as torchrun would (__main__, sys.argv, RANK,
        LOCAL_RANK, ...); its module globals are then in each rank's namespace."""
        c = self._need()
        self._profiled(a, "script", lambda: c.run_script(a.script, a.args, ranks=a.ranks,
                                                         timeout=a.timeout, unchecked=a.unchecked))

    @subcommand("export")
    @magic_arguments()
    @argument("dir", help="folder for train.py, run.sh, job.sbatch, EXPORT.txt and the checkpoint")
    def export(self, a):
        """Write this session as a batch job: the --setup cells, the wrap, the data and the
        train calls as train.py (torchrun), with run.sh, a Slurm job.sbatch and a checkpoint of
        the current state; what cannot be carried over is listed with its reason."""
        info = self._need().export(a.dir)
        print(f"dpnb: wrote {', '.join(info['files'])} and checkpoint/ (step {info['step']}) to "
              f"{info['dir']}; run it with: {info['command']}")
        if info["skipped"]:
            print(f"dpnb: left out {len(info['skipped'])} (also in EXPORT.txt):")
            for what, why in info["skipped"]:
                print(f"  - {what}: {why}")

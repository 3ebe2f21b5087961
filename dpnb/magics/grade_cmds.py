"""%dp grade: the learner's function graded on the live cluster (:mod:`dpnb.session.grading`).

Each handler carries its parser and help (see :mod:`.options`).
"""

from __future__ import annotations

from IPython.core.magic_arguments import argument, magic_arguments

from ..core.grading import EXERCISES
from .options import subcommand


class GradeCommands:
    """Mixed into :class:`dpnb.magics.DPMagics` (``self._need()``)."""

    @subcommand("grade")
    @magic_arguments()
    @argument("exercise", help=f"the exercise: {', '.join(EXERCISES)}")
    @argument("name", nargs="?", default=None,
              help="the function you defined on every rank (default: the exercise's name)")
    @argument("--reveal", action="store_true", help="show the model answer even without a pass")
    @argument("--timeout", type=float, default=None,
              help="seconds each case may run before it counts as a deadlock or a loop")
    def grade(self, a):
        """Run your function on every rank and check its values, the bytes each rank sent and
        the memory it kept; hints grow with each try, the model answer comes after a pass."""
        kw = {} if a.timeout is None else {"timeout": a.timeout}
        return self._need().grade(a.exercise, a.name, reveal=a.reveal, **kw)

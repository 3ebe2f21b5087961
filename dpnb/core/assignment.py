"""An assignment: the exercises a grade is made of, their fixed points, read from TOML (pure).

An instructor writes one file outside dpnb (nbgrader and otter-grader keep
the instructor's source apart from what students get, and so does dpnb):
its exercises, each one's hidden cases, a reference for the values, the
points of every check and the hints that belong to each check, and
optionally a model answer.  dpnb's own exercises are one such file,
``dpnb/assignments/builtin.toml`` (self-study: answers shown after a pass).
An exercise is one of four kinds, each with its own runner on the ranks
(:mod:`dpnb.engine.grading`):

* ``tensor`` -- ``fn(t)`` on every rank's own tensor, in place (or the value
  it returns); its result against ``reference(inputs, rank)``, a function the
  assignment defines, computed on each rank from every rank's input (no
  communication is trusted to check communication).  ``only`` lists the
  torch.distributed operations allowed; ``optimum`` names the collective
  whose ring cost the bytes each rank sends are held to.  A new exercise of
  this kind needs no change to dpnb.
* ``ddp_hook`` -- a DDP communication hook; ``zero1_step`` / ``zero2_step``
  -- one sharded SGD-with-momentum step (dpnb's runners, fixed references).

Every check an exercise plans (:func:`planned_checks`) counts toward the
assignment's maximum, attempted or not: a grade is out of the same total
for every submission.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from .errors import ConfigError

#: the runners dpnb has, and the families of checks each makes
KINDS = {"tensor": ("values", "p2p_only", "bytes"),
         "ddp_hook": ("future", "overlap", "values", "bytes"),
         "zero1_step": ("values", "bytes", "memory"),
         "zero2_step": ("values", "bytes", "memory")}
#: what a check family is called in a report
LABELS = {"p2p_only": "point-to-point only", "bytes": "bytes sent", "future": "returns a Future",
          "overlap": "overlaps backward", "memory": "optimizer state held"}
#: the collectives a bytes check can hold a rank to (their ring cost, :mod:`dpnb.core.comm`)
OPTIMA = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
#: the torch.distributed operations an ``only`` list may name (as :mod:`dpnb.engine.grading` counts them)
OPERATIONS = ("send", "isend", "recv", "irecv", "all_reduce", "broadcast", "reduce", "all_gather",
              "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "gather",
              "scatter", "all_to_all", "all_to_all_single", "barrier")
#: the point-to-point operations
P2P = frozenset({"send", "isend", "recv", "irecv"})
_FIELDS = {"kind", "signature", "statement", "cases", "reference", "only", "optimum", "what",
           "wrong", "answer", "answer_file", "points", "hints"}


@dataclass(frozen=True)
class CheckSpec:
    """One check an exercise always makes: its name in the report, its family, its points."""

    name: str
    family: str
    points: int


@dataclass(frozen=True)
class Exercise:
    """One exercise: the function a learner writes, how it is run and checked, its points."""

    key: str
    kind: str
    signature: str
    statement: str
    cases: tuple
    what: str = "the reference"
    wrong: str = "compare your result with the reference"
    reference: str = ""  # tensor kind: the source of ``def reference(inputs, rank)``
    only: tuple[str, ...] = ()
    optimum: str = ""
    answer: str = ""
    points: tuple[tuple[str, int], ...] = ()
    hint_table: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def families(self) -> tuple[str, ...]:
        fams = KINDS[self.kind]
        if self.kind == "tensor":
            fams = tuple(f for f in fams if (f != "p2p_only" or self.only)
                         and (f != "bytes" or self.optimum))
        return fams

    def points_of(self, family: str) -> int:
        return dict(self.points).get(family, 1)

    def hints_for(self, family: str) -> tuple[str, ...]:
        """The hints that belong to a failing check of ``family`` (a case that did
        not finish: ``runs``, then ``values``)."""
        table = dict(self.hint_table)
        return table.get(family) or (table.get("values", ()) if family == "runs" else ())

    @property
    def hints(self) -> tuple[str, ...]:
        """Every hint, in the order the families are checked (self-study's listing)."""
        return tuple(h for _, hs in self.hint_table for h in hs)

    def case_label(self, index: int) -> str:
        case = self.cases[index]
        if self.kind == "tensor" and len(case) == 1 and isinstance(case[0], int):
            return f"n={case[0]}"
        return f"case {index + 1}"


def planned_checks(ex: Exercise) -> tuple[CheckSpec, ...]:
    """Every check ``ex`` makes, in report order, whatever a submission does."""
    out = []
    for fam in ex.families:
        if fam == "values":
            out += [CheckSpec(f"values ({ex.case_label(i)})", fam, ex.points_of(fam))
                    for i in range(len(ex.cases))]
        elif fam == "memory" and ex.kind == "zero2_step":
            out.append(CheckSpec("gradients and optimizer state held", fam, ex.points_of(fam)))
        elif fam == "p2p_only":
            out.append(CheckSpec(only_label(ex.only), fam, ex.points_of(fam)))
        else:
            out.append(CheckSpec(LABELS[fam], fam, ex.points_of(fam)))
    return tuple(out)


def only_label(allowed: tuple[str, ...]) -> str:
    """The name of the check that only ``allowed`` operations were used."""
    return "point-to-point only" if set(allowed) <= P2P else "allowed operations only"


@dataclass(frozen=True)
class Assignment:
    """Exercises in order, the ranks they are graded on, and whether answers show after a pass."""

    title: str
    exercises: tuple[Exercise, ...]
    world_size: int = 2
    reveal_answers: bool = False
    source: str = field(default="", compare=False)
    graded: tuple[str, ...] = ()  # the exercises a roster is graded on (default: all)

    @property
    def roster_exercises(self) -> tuple[Exercise, ...]:
        """The exercises ``dpnb grade`` grades every submission on, in order; the
        others are for ``%dp grade`` alone (practice)."""
        if not self.graded:
            return self.exercises
        return tuple(self.exercise(k) for k in self.graded)

    def exercise(self, key: str) -> Exercise:
        for e in self.exercises:
            if e.key == key:
                return e
        raise ConfigError(f"no exercise {key!r} in {self.source or self.title}: use one of "
                          f"{', '.join(e.key for e in self.exercises)}")

    @property
    def max_points(self) -> int:
        """Every planned check of every graded exercise: attempted or not, the same for all."""
        return sum(c.points for e in self.roster_exercises for c in planned_checks(e))


def _tuple(v):
    return tuple(_tuple(x) for x in v) if isinstance(v, list) else v


def _exercise(key: str, d: dict, where: str, base: str | None) -> Exercise:
    def bad(what: str) -> ConfigError:
        return ConfigError(f"{where}: exercise {key!r}: {what}")

    unknown = sorted(set(d) - _FIELDS)
    if unknown:
        raise bad(f"unknown field(s) {', '.join(unknown)}; the fields are {', '.join(sorted(_FIELDS))}")
    kind = d.get("kind", "")
    if kind not in KINDS:
        raise bad(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    for need in ("signature", "statement", "cases"):
        if not d.get(need):
            raise bad(f"needs {need!r}")
    if kind == "tensor" and "def reference(" not in d.get("reference", ""):
        raise bad("a tensor exercise needs reference = '''def reference(inputs, rank): ...''' "
                  "(inputs: every rank's input tensor)")
    only = tuple(d.get("only", ()))
    odd = [o for o in only if o not in OPERATIONS]
    if odd:
        raise bad(f"only names {', '.join(odd)}: use {', '.join(OPERATIONS)}")
    if d.get("optimum", "") not in ("", *OPTIMA):
        raise bad(f"optimum {d['optimum']!r} is not one of {', '.join(OPTIMA)}")
    answer = d.get("answer", "")
    if d.get("answer_file"):
        if base is None:
            answer = _package_text("assignments", *d["answer_file"].split("/"))
        else:
            with open(os.path.join(base, d["answer_file"])) as f:
                answer = f.read()
    fams = set(KINDS[kind]) | {"runs"}
    hints = d.get("hints", {})
    points = d.get("points", {})
    for name, table in (("hints", hints), ("points", points)):
        odd = sorted(set(table) - fams)
        if odd:
            raise bad(f"{name} for {', '.join(odd)}: a {kind} exercise's checks are "
                      f"{', '.join(sorted(fams))}")
    if any(not isinstance(p, int) or p < 0 for p in points.values()):
        raise bad("points must be whole numbers >= 0")
    return Exercise(key, kind, d["signature"], " ".join(d["statement"].split()),
                    _tuple(d["cases"]), d.get("what", "the reference"),
                    d.get("wrong", "compare your result with the reference"),
                    d.get("reference", ""), only, d.get("optimum", ""), answer,
                    tuple(sorted(points.items())),
                    tuple((f, tuple(" ".join(h.split()) for h in hs)) for f, hs in hints.items()))


def parse_assignment(text: str, where: str = "assignment", base: str | None = None) -> Assignment:
    """An :class:`Assignment` from TOML ``text``; ``base``: the folder ``answer_file``
    paths are read from (None: dpnb's package data)."""
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where} is not valid TOML: {e}") from None
    exs = d.get("exercises")
    if not isinstance(exs, dict) or not exs:
        raise ConfigError(f"{where} has no [exercises.NAME] table: define at least one exercise")
    n = d.get("world_size", 2)
    if not isinstance(n, int) or n < 2:
        raise ConfigError(f"{where}: world_size {n!r} must be a whole number >= 2")
    graded = tuple(d.get("graded", ()))
    odd = [k for k in graded if k not in exs]
    if odd:
        raise ConfigError(f"{where}: graded names {', '.join(odd)}, not among the exercises "
                          f"({', '.join(exs)})")
    unknown = sorted(set(d) - {"title", "world_size", "reveal_answers", "graded", "exercises"})
    if unknown:
        raise ConfigError(f"{where}: unknown top-level key(s) {', '.join(unknown)}; the keys are "
                          "title, world_size, reveal_answers, graded and [exercises.NAME]")
    return Assignment(d.get("title", where), tuple(_exercise(k, v, where, base)
                                                   for k, v in exs.items()),
                      n, bool(d.get("reveal_answers", False)), where, graded)


def _package_text(*parts: str) -> str:
    """A file of dpnb's package data, one path part at a time: where dpnb is found
    twice on the path (an editable install and ``PYTHONPATH``), ``files()`` is a
    ``MultiplexedPath`` whose ``joinpath`` takes one part on Python 3.11."""
    p = resources.files("dpnb")
    for part in parts:
        p = p.joinpath(part)
    return p.read_text()


def load_assignment(path: str | None = None) -> Assignment:
    """The assignment at ``path`` (TOML), or dpnb's own exercises when None."""
    if path is None:
        text = _package_text("assignments", "builtin.toml")
        return parse_assignment(text, "dpnb's built-in assignment")
    if not os.path.isfile(path):
        raise ConfigError(f"no assignment file at {path}: give the instructor's .toml")
    with open(path) as f:
        return parse_assignment(f.read(), path, os.path.dirname(os.path.abspath(path)))

"""The ranks' side of grading a roster: one submission's cells at a time, then the namespace back.

``dpnb grade`` (:mod:`dpnb.session.roster`) runs every submission on one
cluster the grader started.  Before a submission, :func:`begin` keeps the
namespace as it is (the grader's clean one); the submission's ``%%dp``
cells run on every rank in that namespace, as in the student's notebook;
its other cells -- the notebook kernel's own -- run on rank 0 only, in a
namespace of their own (:func:`kernel_cells`), with dpnb's magics in them
(``%dp start``, ``%dp grade``...) read as the grader's to do, not run.
:func:`end` then gives the namespace back as :func:`begin` found it, so the
next submission starts from the same state.

:func:`intact` is the grader's check that a submission left dpnb's
counters and torch.distributed as they were: the objects bound in those
modules are compared with the ones this engine had before any submission
ran.  A changed one voids the submission's grade and the grader restarts
the cluster (a patch can outlive the namespace).
"""

from __future__ import annotations

import logging
import sys

from dpnb.engine.state import get_state

log = logging.getLogger(__name__)

#: the modules whose bindings a submission must leave alone: the grader's counters and
#: runners, and what they count through
GUARDED = ("torch.distributed", "torch.distributed.distributed_c10d",
           "torch.distributed._functional_collectives", "torch.utils._python_dispatch",
           "dpnb.engine.grading", "dpnb.engine.gradecount", "dpnb.engine.gradesandbox",
           "dpnb.core.grading", "dpnb.core.assignment")

def _bindings() -> dict[str, dict[str, object]]:
    """What each guarded module binds, to the object: its names, the methods of the
    classes it defines and the code of its functions (a patch may swap any)."""
    out = {}
    for name in GUARDED:
        mod = sys.modules.get(name)
        if mod is None:
            __import__(name)
            mod = sys.modules[name]
        # the objects themselves, not their ids: a freed object's id can be reused
        seen: dict[str, object] = {}
        for k, v in vars(mod).items():
            if k.startswith("__") or not callable(v):
                continue  # data (counters, the world's registry) changes as groups form
            seen[k] = v
            if getattr(v, "__module__", None) != name:
                continue  # imported from elsewhere: its own module is guarded, or not ours
            if isinstance(v, type):
                seen.update({f"{k}.{a}": x for a, x in vars(v).items() if callable(x)})
                seen.update({f"{k}.{a}.__code__": x.__code__ for a, x in vars(v).items()
                             if hasattr(x, "__code__")})
            elif hasattr(v, "__code__"):
                seen[f"{k}.__code__"] = v.__code__
        out[name] = seen
    return out


def intact(ns: dict) -> list[str]:
    """The ``module.name`` bindings in :data:`GUARDED` changed since this engine's first look."""
    st = get_state(ns)
    now = _bindings()
    if st.grading_reference is None:
        st.grading_reference = now
        return []
    changed = []
    for mod, names in st.grading_reference.items():
        cur = now.get(mod, {})
        changed += [f"{mod}.{k}" for k in names if cur.get(k, _MISSING) is not names[k]]
        changed += [f"{mod}.{k} (added)" for k in cur if k not in names]
    return sorted(changed)


def begin(ns: dict) -> None:
    """Keep the namespace as it is now; a fresh kernel namespace for the submission."""
    st = get_state(ns)
    if st.grading_reference is None:  # before any submission: what the guarded modules bind
        st.grading_reference = _bindings()
    st.grading_baseline = dict(ns)
    st.grading_kernel = {"__name__": "__main__", "__builtins__": __builtins__,
                         "get_ipython": _Magics}


def ready(ns: dict, names: list[str]) -> tuple[list[str], list[str]]:
    """After the cells, before the grades (one round trip): the guarded bindings
    changed (:func:`intact`), and which of ``names`` this rank lacks."""
    return intact(ns), [n for n in names if n not in ns]


def end(ns: dict, again: bool = False) -> list[str]:
    """The guarded bindings the submission changed (:func:`intact`); the namespace
    back as :func:`begin` found it, and with ``again`` kept for the next
    submission at once (:func:`begin`: the grader's next round trip saved)."""
    changed = intact(ns)
    st = get_state(ns)
    base = st.grading_baseline
    if base is None:
        return changed
    left = sorted(k for k in ns if k not in base and not k.startswith("_"))
    for k in [k for k in ns if k not in base]:
        del ns[k]
    for k, v in base.items():
        if ns.get(k, _MISSING) is not v:
            ns[k] = v
    st.grading_baseline = None
    st.grading_kernel = None
    log.info("grading: the submission's names %s dropped", left[:20])
    if again and not changed:
        begin(ns)
    return changed


def kernel_cells(ns: dict, cells: list[tuple[int, str]]) -> dict | None:
    """The submission's kernel cells, in order, on this rank (the grader calls
    rank 0, once per submission): None when all ran, else the first failure's
    cell number and error (the cells after it are not run, as in a kernel)."""
    from IPython.core.inputtransformer2 import TransformerManager  # lazy: only for grading

    st = get_state(ns)
    if st.grading_kernel is None:
        raise RuntimeError("kernel_cells outside a submission: the grader calls begin first")
    tm = TransformerManager()
    for index, code in cells:
        st.grading_kernel_at = index  # what the grader asks after a timeout (kernel_at)
        try:
            exec(compile(tm.transform_cell(code), f"<cell {index}>", "exec"), st.grading_kernel)
        except Exception as e:  # the submission's error: the notebook stops here  # noqa: BLE001
            log.info("grading: kernel cell %d raised %s", index, type(e).__name__)
            return {"cell": index, "ename": type(e).__name__, "evalue": str(e)[:300]}
    return None


def kernel_at(ns: dict) -> int | None:
    """The kernel cell :func:`kernel_cells` started last (after a timeout: the one that hung)."""
    return get_state(ns).grading_kernel_at


class _Magics:
    """``get_ipython()`` in a kernel cell (the class itself: its methods are
    static): magics and shell commands are the grader's to run or not (``%dp
    start`` is the grader's cluster, ``%dp grade`` the grader's grading), so
    none runs here."""

    @staticmethod
    def run_line_magic(name, line, *a, **k):
        log.info("grading: %%%s %s not run (the grader's)", name, line)

    @staticmethod
    def run_cell_magic(name, line, cell, *a, **k):
        log.info("grading: %%%%%s %s not run in the kernel (the grader's)", name, line)

    @staticmethod
    def system(cmd, *a, **k):
        log.info("grading: !%s not run", cmd)

    @staticmethod
    def getoutput(cmd, *a, **k):
        log.info("grading: !%s not run", cmd)
        return []


_MISSING = object()

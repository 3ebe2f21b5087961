"""Where a SIGINT may raise while an engine handles a request (dpnb.engine.proc.process.in_the_code).

The cluster tier (test_spine_api) lands one after a cell's code; here the
apply side: only the function an ``apply`` runs -- the ``exec`` right under
ipyparallel's ``do_apply`` -- counts as the code, never do_apply's own work
around it (serializing the result, formatting the error) that leads to the reply.
"""

import sys

from dpnb.engine.proc.process import in_the_code


def do_apply(fn, helper):
    """Shaped as ipyparallel's: the user's function runs in an ``exec``; the
    kernel's own work (``helper``) runs beside it."""
    ns = {"fn": fn}
    exec("out = fn()", ns)  # noqa: S102 -- the filename is "<string>", as there
    return ns["out"], helper()


def _here():
    return sys._getframe()


def test_inside_the_applied_function_is_the_code_and_the_kernels_own_work_is_not():
    inside, beside = do_apply(lambda: _here(), _here)
    assert in_the_code(inside, None, do_apply.__code__)
    assert not in_the_code(beside, None, do_apply.__code__)
    assert not in_the_code(sys._getframe(), None, do_apply.__code__)  # no request at all


def test_anything_under_a_cells_statements_is_the_code():
    def run_ast_nodes():
        return _here()

    assert in_the_code(run_ast_nodes(), run_ast_nodes.__code__, None)
    assert not in_the_code(_here(), run_ast_nodes.__code__, None)

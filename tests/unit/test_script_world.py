"""``%dp run``'s module world and ``init_process_group``'s strictness, in one process.

A script's siblings are its own (as in torchrun's fresh process) and the rank's
``sys.modules`` / ``sys.path`` / ``sys.argv`` / ``__main__`` are given back;
``init_process_group`` arguments torch refuses raise as torch raises them.
"""

from __future__ import annotations

import sys
import types
from datetime import timedelta

import pytest
import torch

from dpnb.engine.group.lifecycle import AS_TORCHRUN, _as_torch
from dpnb.engine.cell.script import run


def _script(folder, helper_value: str):
    folder.mkdir()
    (folder / "helpers.py").write_text(f"VALUE = {helper_value!r}\n")
    (folder / "pkg").mkdir()
    (folder / "pkg" / "__init__.py").write_text("from . import inner\n")
    (folder / "pkg" / "inner.py").write_text(f"WHO = {helper_value!r}\n")
    src = ("import colorsys, torch\nimport helpers, pkg\n"
           "got = (helpers.VALUE, pkg.inner.WHO, helpers.__file__)\n")
    (folder / "main.py").write_text(src)
    return str(folder / "main.py"), src


def test_each_script_imports_its_own_siblings_and_gives_the_modules_back(tmp_path):
    a, src_a = _script(tmp_path / "a", "a")
    b, src_b = _script(tmp_path / "b", "b")
    # a cell imported a module named like the scripts' sibling (from elsewhere)
    mine = types.ModuleType("helpers")
    mine.__file__ = str(tmp_path / "notebook" / "helpers.py")
    sys.modules["helpers"] = mine
    torch_mod, main = sys.modules["torch"], sys.modules.get("__main__")
    path0, argv0 = list(sys.path), list(sys.argv)
    sys.modules.pop("colorsys", None)
    try:
        ns: dict = {}
        run(ns, a, [], src_a)
        assert ns["got"] == ("a", "a", str(tmp_path / "a" / "helpers.py"))
        run(ns, b, [], src_b)  # not a's, cached: b's own
        assert ns["got"] == ("b", "b", str(tmp_path / "b" / "helpers.py"))
        (tmp_path / "a" / "helpers.py").write_text("VALUE = 'a, edited'\n")
        run(ns, a, [], src_a)  # run again: fresh, as a new torchrun process
        assert ns["got"][0] == "a, edited"
        # given back: the cell's module, no sibling left, nothing shared re-imported
        assert sys.modules["helpers"] is mine
        assert not any(k == "pkg" or k.startswith("pkg.") for k in sys.modules)
        assert sys.modules["torch"] is torch_mod and "colorsys" in sys.modules
        assert sys.modules.get("__main__") is main
        assert sys.path == path0 and sys.argv == argv0
    finally:
        sys.modules.pop("helpers", None)


def test_main_is_the_script_during_its_run_and_the_ranks_again_after_even_a_failure(tmp_path):
    """``sys.modules["__main__"]`` is the script's module while it runs (a class it
    defines pickles as ``__main__.Point``, as under torchrun) and the rank's own
    again afterwards -- after a clean end, ``sys.exit(0)`` and a raise alike."""
    path = str(tmp_path / "train.py")
    src = ("import pickle, sys\nclass Point:\n    pass\n"
           "seen = (sys.modules['__main__'].__dict__ is globals(), pickle.dumps(Point()))\n"
           "if END == 'exit':\n    sys.exit(0)\nif END == 'raise':\n    raise ValueError('x')\n")
    main = sys.modules.get("__main__")
    for end in ("none", "exit", "raise"):
        ns: dict = {}
        try:
            run(ns, path, [], f"END = {end!r}\n" + src)
        except ValueError:
            assert end == "raise"
        assert ns["seen"][0] and b"__main__" in ns["seen"][1] and b"Point" in ns["seen"][1], end
        assert sys.modules.get("__main__") is main, end


def test_a_script_folder_holding_dpnb_or_a_venv_never_re_imports_them(tmp_path):
    """A script at a repository's root: dpnb's own package and the venv lie below
    its folder, and stay shared (libraries are never the script's)."""
    import dpnb

    root = __import__("os").path.dirname(__import__("os").path.dirname(dpnb.__file__))
    path = __import__("os").path.join(root, "scratch_script_world.py")
    before = sys.modules["dpnb"], sys.modules["dpnb.engine.cell.script"], sys.modules["torch"]
    ns: dict = {}
    run(ns, path, [], "import dpnb, torch\nx = 1\n")
    assert (sys.modules["dpnb"], sys.modules["dpnb.engine.cell.script"], sys.modules["torch"]) == before


@pytest.mark.parametrize("kwargs, exc, message", [
    # torch 2.13 distributed_c10d.init_process_group / _new_process_group_helper
    (dict(device_id=torch.device("cpu")), ValueError,
     "init_process_group device_id parameter must be an accelerator with an index"),
    (dict(timeout=30), TypeError,
     "Expected timeout argument to be of type datetime.timedelta, got 30"),
    (dict(store=object(), init_method="env://"), AssertionError,
     "Cannot specify both init_method and store."),
    (dict(store=object()), AssertionError, "world_size must be positive if using store"),
    (dict(init_method="nope://x"), RuntimeError, "No rendezvous handler for nope://"),
    (dict(init_method="tcp://h:1?rank=0", rank=0), AssertionError,
     "has node-specific arguments(rank, world_size) already."),
])
def test_what_torch_refuses_is_refused_as_torch_refuses_it(kwargs, exc, message):
    args = dict(init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                device_id=None)
    args.update(kwargs)
    with pytest.raises(exc) as ei:
        _as_torch(**args)
    assert type(ei.value) is exc and message in str(ei.value) and AS_TORCHRUN in str(ei.value)


def test_what_torch_accepts_passes_with_the_url_rank_for_the_comparison():
    ok = dict(timeout=timedelta(seconds=5), world_size=-1, rank=-1, store=None, device_id=None)
    assert _as_torch(init_method=None, **ok) == (None, -1, -1)
    assert _as_torch(init_method="env://", **ok) == (None, -1, -1)
    assert _as_torch(init_method="tcp://h:1?rank=1&world_size=2", **ok) == (None, 1, 2)

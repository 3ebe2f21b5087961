"""Every course notebook runs top to bottom in the "Python 3 (dpnb)" kernel.

Each notebook is executed with nbclient in a real kernel (2 CPU engines, ~30 s
for the quick start); a failing cell fails the test with its traceback.  Also
checked: no process the kernel started (controller, engines, dpnb's reaper)
outlives the kernel, even when a cell failed.  The instant checks of the
committed files are in tests/unit/test_repo_files.py.

    python -m pytest tests/notebook
"""

from __future__ import annotations

from helpers import nbutil as nbu
import pytest

NOTEBOOKS = nbu.notebooks()
CELL_TIMEOUT = 180


@pytest.fixture(scope="module")
def dpnb_kernel(tmp_path_factory):
    """The dpnb kernelspec in a temp prefix, found through JUPYTER_PATH."""
    prefix = tmp_path_factory.mktemp("kernelspec")
    jp = nbu.install_kernelspec(prefix)
    mp = pytest.MonkeyPatch()
    mp.setenv("JUPYTER_PATH", jp)
    yield "dpnb"
    mp.undo()


@pytest.mark.timeout(CELL_TIMEOUT * 2 + 120)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, dpnb_kernel):
    if path.name == "00_quickstart.ipynb" and not nbu.browser_missing():
        # one place per scenario: where Chromium is, the quick start runs as a
        # learner runs it, Run All in JupyterLab (tests/browser/test_lab.py, which
        # checks the same outputs and the rendered widgets); here only without one
        pytest.skip("the quick start runs in JupyterLab here (tests/browser/test_lab.py)")
    run = nbu.execute_notebook(path, kernel_name=dpnb_kernel, cell_timeout=CELL_TIMEOUT)
    print(f"{path.name}: {run.seconds:.1f} s, kernel pid {run.kernel_pid}, "
          f"{len(run.children)} processes under it")
    problems = []
    if run.error is not None:
        problems.append(f"a cell failed:\n{run.error}")
    problems += nbu.errors(run.nb)
    if run.leftover:
        problems.append(f"processes outlived the kernel (killed now): {run.leftover}")
    assert not problems, f"{path.name}:\n" + "\n".join(problems)

    if path.name == "00_quickstart.ipynb":
        _check_quickstart(run)
    if path.name == "10_profile_your_step.ipynb":
        _check_profile_chapter(run)


def _check_profile_chapter(run):
    """The chapter's claims hold in its own output: rank 1, made late, is named."""
    (late,) = [nbu.cell_text(c) for c in run.nb.cells
               if c.cell_type == "code" and "time.sleep(0.08)" in c.source]
    assert "Straggler: rank 1 entered" in late, late
    assert "merged.json" in late and "Profiled cell on" in late, late


def _check_quickstart(run):
    nb = run.nb
    start = nbu.find_cell(nb, "%dp start")
    assert "2 ranks up" in nbu.cell_text(start)
    reduce_ = nbu.find_cell(nb, "%%dp\nt = torch.tensor")
    assert "all_reduce gives 3" in nbu.cell_text(reduce_), nbu.cell_text(reduce_)

    train = nbu.find_cell(nb, "%dp train")
    views = [o for o in train.outputs
             if o["output_type"] == "display_data" and nbu.WIDGET_VIEW in o["data"]]
    assert views, f"no progress widget in the train cell: {train.outputs}"
    assert "20 steps" in nbu.cell_text(train), nbu.cell_text(train)
    # the widget's state was saved with the notebook: its VBox is the dpnb one
    state = nb.metadata.get("widgets", {}).get(
        "application/vnd.jupyter.widget-state+json", {}).get("state", {})
    vid = views[0]["data"][nbu.WIDGET_VIEW]["model_id"]
    assert "dpnb-train-progress" in state.get(vid, {}).get("state", {}).get("_dom_classes", []), \
        "the train cell's widget is not the progress widget"

    assert "dpnb: OK" in nbu.cell_text(nbu.find_cell(nb, "%dp check"))
    stop = nbu.find_cell(nb, "%dp stop")
    assert "cluster stopped" in nbu.cell_text(stop), nbu.cell_text(stop)
    # the engines were the kernel's children and are gone
    assert run.children, "no processes were seen under the kernel: was a cluster started?"


@pytest.mark.timeout(240)
def test_failed_notebook_leaves_no_engines(dpnb_kernel, tmp_path):
    """A cell fails while the engines run: the kernel's shutdown stops them."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    path = tmp_path / "fails.ipynb"
    nbformat.write(new_notebook(cells=[
        new_code_cell("%dp start -n 2"),
        new_code_cell("%%dp\nimport os\nprint(os.getpid())"),
        new_code_cell("raise RuntimeError('boom')"),
        new_code_cell("%dp stop"),
    ], metadata={"kernelspec": {"name": "dpnb", "display_name": "Python 3 (dpnb)"}}), path)
    run = nbu.execute_notebook(path, kernel_name=dpnb_kernel, cell_timeout=120)
    assert run.error is not None and "boom" in str(run.error)
    assert "cluster stopped" not in nbu.cell_text(run.nb.cells[3])  # never ran
    engine_pids = {int(x) for x in nbu.cell_text(run.nb.cells[1]).split() if x.isdigit()}
    assert len(engine_pids) == 2 and engine_pids <= set(run.children), \
        (nbu.cell_text(run.nb.cells[1]), run.children)
    assert not run.leftover, f"still running after the kernel shut down: {run.leftover}"

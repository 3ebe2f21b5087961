"""The quick start, run the way a learner runs it: JupyterLab in Chromium.

Starts ``jupyter lab`` on a free local port with a random token, temporary
Jupyter/JupyterLab state dirs (the notebooks run on the default "Python 3
(ipykernel)" kernel, as right after the README's install, and load dpnb in
their first cell); drives Debian's Chromium headless with Playwright's Python API (the
package only: no ``playwright install``, the browser is /usr/bin/chromium);
opens notebooks/00_quickstart.ipynb, does Run -> Run All Cells, and checks the
rendered page: no error output, the live progress widget, the quiz widgets.
A full-page screenshot goes to the test's tmp_path and to
test-artifacts/browser/ (git-ignored).

The notebook in the repository is never written: autosave is off, checkpoints
go to a temp dir, and the file's bytes are compared before and after.

    python -m pytest -m browser tests/browser
"""

from __future__ import annotations

import contextlib
import re
import shutil
import time

import pytest

from helpers import nbutil as nbu
from helpers.labpage import NOTEBOOK, _open_notebook, _scratch_notebook, _screenshot

RUN_ALL_TIMEOUT_S = 240
# errors render as stderr text in JupyterLab (tracebacks and a cell's stderr alike)
STDERR = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'



def _all_ran(page) -> dict:
    return page.evaluate("""() => {
        const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
        const prompts = Array.from(nb.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt'))
            .map(e => e.innerText.trim());
        const ind = document.querySelector('.jp-Notebook-ExecutionIndicator');
        return {prompts, status: ind ? ind.getAttribute('data-status') : null};
    }""")


def _assert_no_error_output(page) -> None:
    stderr = page.locator(STDERR).all_inner_texts()
    bad = [t for t in stderr if re.search(r"Traceback|Error", t)]
    assert not bad, "error output:\n" + "\n---\n".join(t[-1500:] for t in bad)


def _run_all(page, base: str, token: str, notebook: str) -> None:
    """Open ``notebook`` (a path under the server's root) in Lab, wait for its
    kernel, Run -> Run All Cells, and wait until every cell ran (or one failed)."""
    _open_notebook(page, base, token, notebook)

    # Run -> Run All Cells
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-item:not(.lm-mod-disabled)", has=page.locator(
        ".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$"))).click()

    n_code = page.locator(".jp-Notebook .jp-CodeCell").count()
    deadline = time.monotonic() + RUN_ALL_TIMEOUT_S
    state = _all_ran(page)
    while time.monotonic() < deadline:
        state = _all_ran(page)
        done = [p for p in state["prompts"] if re.fullmatch(r"\[\d+\]:", p)]
        if state["status"] == "idle" and len(done) == n_code:
            break
        # a failing cell ends Run All early (the cells after it never run)
        if state["status"] == "idle" and done and not any("*" in p for p in state["prompts"]) \
                and page.locator(f"{STDERR} >> text=/Traceback|Error/").count():
            break
        if state["status"] == "dead":
            pytest.fail(f"the kernel died during Run All: {state}")
        page.wait_for_timeout(1000)
    else:
        pytest.fail(f"Run All did not finish in {RUN_ALL_TIMEOUT_S} s: {state}")


def test_run_all_in_jupyterlab(browser, lab, tmp_path):  # browser first: skip before starting Lab
    base, token = lab
    nb_path = nbu.REPO / NOTEBOOK
    before = nb_path.read_bytes()
    checkpoints = nb_path.parent / ".ipynb_checkpoints"
    checkpoints_before = sorted(checkpoints.glob("*")) if checkpoints.exists() else []
    artifacts = nbu.ARTIFACTS / "browser"
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = tmp_path / "00_quickstart.png"

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    console_errors: list[str] = []
    page.on("console", lambda m: m.type == "error" and console_errors.append(m.text))
    try:
        _run_all(page, base, token, NOTEBOOK)
        page.wait_for_timeout(1500)  # last widget/image updates
        (tmp_path / "00_quickstart.html").write_text(page.content())
        _screenshot(page, shot)
        shutil.copy(shot, artifacts / shot.name)
        (artifacts / "00_quickstart-failure.png").unlink(missing_ok=True)  # from an older run

        # no error output anywhere
        stderr = page.locator(STDERR).all_inner_texts()
        bad = [t for t in stderr if re.search(r"Traceback|Error", t)]
        assert not bad, "error output in the notebook:\n" + "\n---\n".join(t[-1500:] for t in bad)

        text = page.locator(".jp-Notebook").inner_text()
        assert "2 ranks up" in text
        assert "all_reduce gives 3" in text
        assert "dpnb: OK" in text
        assert "cluster stopped" in text

        # the live progress widget rendered in the train cell, and it finished
        progress = page.locator(".jp-Notebook .dpnb-train-progress")
        assert progress.count() == 1, "no .dpnb-train-progress widget on the page"
        # ipywidgets 8 renders IntProgress as .widget-hprogress > .progress > .progress-bar
        assert progress.locator(".widget-hprogress, .widget-progress").count() == 1
        assert progress.locator("progress, .progress-bar").count() >= 1
        assert "step 20/20" in progress.inner_text()
        assert progress.locator("img").count() == 1  # the live loss curve

        # the dashboard, shown before training, followed it to the end: the
        # last step and the whole loss curve, not the first publish only
        dash = page.locator(".jp-CodeCell", has=page.locator(
            ".jp-InputArea-editor", has_text=re.compile(r"%dp dashboard")))
        assert dash.count() == 1, "no %dp dashboard cell in the quick start"
        dtext = dash.first.locator(".jp-OutputArea").inner_text()
        assert "(20/20)" in dtext, f"the dashboard did not reach step 20/20:\n{dtext[:800]}"
        assert "loss curve: 20 steps (0-19)" in dtext, dtext[:800]

        # the check questions are widgets; a wrong pick, then the right one,
        # each explained only after Check
        quizzes = page.locator(".jp-Notebook .dpnb-quiz")
        assert quizzes.count() == 2
        _answer_a_question(quizzes.first, "00.1")

        # the memory view renders its chart (predicted beside measured)
        mem = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea-editor",
                                                            has_text=re.compile(r"%dp memory")))
        assert mem.count() == 1, "no %dp memory cell in the quick start"
        assert mem.first.locator(".jp-OutputArea-output img, .jp-OutputArea-output svg, "
                                 ".jp-OutputArea-output canvas").count() >= 1, \
            "the %dp memory cell shows no chart"
    except BaseException:
        try:
            (tmp_path / "failure.html").write_text(page.content())
            _screenshot(page, tmp_path / "failure.png")
            shutil.copy(tmp_path / "failure.png", artifacts / "00_quickstart-failure.png")
        except Exception:
            pass
        raise
    finally:
        page.close()
        assert nb_path.read_bytes() == before, f"{NOTEBOOK} was modified by the test"
        assert (sorted(checkpoints.glob("*")) if checkpoints.exists() else []) \
            == checkpoints_before, f"Lab wrote a checkpoint into {checkpoints}"
    print(f"screenshot: {shot} (copy in {artifacts}); console errors: {console_errors[:5]}")


def _answer_a_question(box, qid: str) -> None:
    """Click a wrong option and Check, then the right one and Check; read the
    explanation each time.  Nothing is explained before the first Check."""
    from dpnb import quiz

    q = quiz.get(qid)  # the order the widget shows
    assert q.prompt[:40] in box.inner_text()
    assert not any(e[:40] in box.inner_text() for e in q.explanations)
    labels = box.locator(".widget-radio-box label")
    assert labels.count() == len(q.options)
    wrong = (q.answer + 1) % len(q.options)
    check = box.locator("button", has_text="Check")
    for pick, head in ((wrong, "Not quite"), (q.answer, "Correct.")):
        labels.nth(pick).click()
        check.click()
        # The verdict comes back from the kernel, which may still be busy with
        # the Run All that brought the widget up: wait for it, bounded.
        text = box.inner_text()
        for _ in range(60):
            if head in text and q.explanations[pick][:40] in text:
                break
            box.page.wait_for_timeout(250)
            text = box.inner_text()
        assert head in text and q.explanations[pick][:40] in text, (pick, text[-600:])


@contextlib.contextmanager
def _ran(browser, lab, name: str, cells: list[str], settle_ms: int = 1500):
    """A scratch notebook of ``cells`` run in Lab: yields (page, output areas); the
    screenshot is taken and error outputs are refused before the test looks."""
    base, token = lab
    nb_file = _scratch_notebook(name, cells)
    shot = nb_file.with_suffix(".png")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        _run_all(page, base, token, str(nb_file.relative_to(nbu.REPO)))
        page.wait_for_timeout(settle_ms)
        _screenshot(page, shot)
        _assert_no_error_output(page)
        yield page, page.locator(".jp-Notebook .jp-CodeCell .jp-OutputArea")
    finally:
        page.close()
    print(f"screenshot: {shot}")


VIEWS32_CELLS = [
    "import sys\nsys.path.insert(0, {tests!r})\n"
    "from helpers import recorded as R\n"
    "from dpnb import display\n"
    "from dpnb.widgets import dashboard, gradsync, memory, stragglers",
    "gradsync.show(records=R.records32(slow=17))",
    "memory.show(live=memory.live_data(R.snapshots32('zero3', leak_rank=7)))",
    "stragglers.show(records=R.stragglers32(slow=23))",
    "box = dashboard.show(status=R.status32(dead=(13,)), live=False)",
    "print(display.status_text(R.status32(dead=(13,))))",
]


def test_views_at_32_ranks_in_jupyterlab(browser, lab, tmp_path):
    """Every many-rank view, from recorded 32-rank data, rendered by Lab:
    the widgets draw, nothing errs, and the odd rank of each set is named."""
    cells = [c.format(tests=str(nbu.REPO / "tests")) for c in VIEWS32_CELLS]
    with _ran(browser, lab, "views32.ipynb", cells, settle_ms=2000) as (_, outs):
        texts = [outs.nth(i).inner_text() for i in range(outs.count())]
        charts = [outs.nth(i).locator("img, svg, canvas").count() for i in range(outs.count())]
        # cells 1-4: a widget with its chart each
        assert all(n >= 1 for n in charts[1:5]), charts
        assert "slowest rank 17" in texts[1] and "all 32 ranks" in texts[1]
        assert "rank 7" in texts[2]
        assert "rank 23" in texts[3]
        assert "rank 13" in texts[4] and "dead" in texts[4]
        status = texts[5].splitlines()
        assert len(status) <= 6 and any("rank 13" in line for line in status), status


TABS_CELLS = [
    "%load_ext dpnb\n%dp start -n 2",
    "%%dp\nprint(f'rank {rank} says {rank * 11}')",
    "%%dp\nimport time\nfor i in range(5):\n    print(f'tick {i} on rank {rank}', flush=True)\n"
    "    time.sleep(0.5)",
    "%%dp\nprint('the same everywhere')",
    "%dp stop",
]


def test_rank_tabs_in_jupyterlab(browser, lab, tmp_path):
    """Ranks that print differently get tabs -- the folded view first, then one per
    rank -- in a quick cell and in one that streams; identical output stays text."""
    with _ran(browser, lab, "tabs.ipynb", TABS_CELLS) as (page, outs):
        quick, streamed, same = (outs.nth(i).locator(".dpnb-rank-tabs") for i in (1, 2, 3))
        assert same.count() == 0 and "[all 2 ranks]" in outs.nth(3).inner_text()
        for box, words in ((quick, ("rank 1 says 11", "rank 0 says 0")),
                           (streamed, ("tick 4 on rank 1", "tick 4 on rank 0"))):
            assert box.count() == 1, "no per-rank tabs"
            titles = [t.strip() for t in box.locator(".lm-TabBar-tab").all_inner_texts()]
            assert titles == ["[all 2 ranks]", "rank 0", "rank 1"], titles
            folded = box.locator(".widget-html:visible, .jupyter-widget-html:visible").first
            assert words[0] in folded.inner_text() and words[1] in folded.inner_text()
            box.locator(".lm-TabBar-tab", has_text=re.compile(r"^rank 1$")).click()
            page.wait_for_timeout(300)
            pane = box.locator(".widget-html:visible, .jupyter-widget-html:visible").first.inner_text()
            assert words[0] in pane and words[1] not in pane, pane


PROFILE_CELLS = [
    "%load_ext dpnb\n%dp start -n 2",
    "%%dp\nimport time, torch, torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "torch.manual_seed(0)\n"
    "ddp_model = DDP(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]))\n"
    "optimizer = torch.optim.SGD(ddp_model.parameters(), lr=1e-3)\nx = torch.randn(256, 256)",
    "%%dp --profile\nfor _ in range(2):\n    loss = ddp_model(x).square().mean()\n"
    "    if dist.get_rank() == 1:\n        time.sleep(0.08)\n"
    "    loss.backward()\n    optimizer.step()\n    optimizer.zero_grad()",
    "%dp profile --ranks 1",
    "%dp stop",
]


def test_a_profiled_cell_in_jupyterlab(browser, lab, tmp_path):
    """``%%dp --profile`` on a hand-written DDP step in Lab: the figure draws, the text
    names the late rank, and ``%dp profile --ranks`` shows it again with one lane pair."""
    with _ran(browser, lab, "profile.ipynb", PROFILE_CELLS) as (page, outs):
        profiled, again = outs.nth(2), outs.nth(3)
        assert profiled.locator("img").count() >= 1, "no figure under the profiled cell"
        text = profiled.inner_text()
        assert "Straggler: rank 1 entered" in text and "merged.json" in text, text[-800:]
        assert again.locator("img").count() >= 1 and "Straggler: rank 1" in again.inner_text()
        assert again.locator("select").count() >= 1  # the lane chooser

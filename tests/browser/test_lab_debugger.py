"""JupyterLab's own debugger on a dpnb cluster, in Chromium.

One notebook on the default kernel: ``%dp start -n 2``, then a ``%%dp`` cell.
The debugger is switched on with the notebook toolbar's bug button, a
breakpoint set by a click in the ``%%dp`` cell's gutter on its third line,
the cell run: the Callstack panel shows both ranks stopped at that line
("rank 0 · <module>", "rank 1 · <module>"), the Variables panel shows the
rank's ``x``, one Continue lets both ranks finish and the cell print both
ranks' lines.  After a page reload the same cell stops again (the kernel's
debugger and its breakpoint outlive the page).  The screenshot goes to test-artifacts/browser/lab-debugger.png.

    python -m pytest -m browser tests/browser/test_lab_debugger.py
"""

from __future__ import annotations

import re
import time

import pytest

from helpers import nbutil as nbu

from helpers.labpage import _open_notebook, _scratch_notebook, _screenshot

CELLS = ["%load_ext dpnb\n%dp start -n 2", "%%dp\nx = rank * 10\ny = x + 1\nprint(y)"]


def _run_cell(page, i: int) -> None:
    cell = page.locator(".jp-Notebook .jp-CodeCell").nth(i)
    cell.locator(".jp-InputArea-prompt").click()
    page.keyboard.press("Shift+Enter")


def _outputs(page, i: int) -> str:
    return page.locator(".jp-Notebook .jp-CodeCell").nth(i).locator(".jp-OutputArea").inner_text()


def _wait(page, what: str, check, timeout_s: float = 90, seen=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout_s:.0f} s {seen()}".rstrip())
        page.wait_for_timeout(300)


def _gutter_click(page, i: int, line: int) -> None:
    """Click the breakpoint gutter of cell ``i`` beside its ``line`` (1-based)."""
    cell = page.locator(".jp-Notebook .jp-CodeCell").nth(i)
    row = cell.locator(".cm-line").nth(line - 1).bounding_box()
    gutter = cell.locator("div.cm-gutter.cm-breakpoint-gutter").bounding_box()
    page.mouse.click(gutter["x"] + gutter["width"] / 2, row["y"] + row["height"] / 2)


def test_a_breakpoint_in_a_dp_cells_gutter_stops_both_ranks_in_the_callstack(browser, lab):
    base, token = lab
    nb_file = _scratch_notebook("lab-debugger.ipynb", CELLS)
    shot = nbu.ARTIFACTS / "browser" / "lab-debugger.png"
    page = browser.new_page(viewport={"width": 1500, "height": 1000})
    try:
        _open_notebook(page, base, token, str(nb_file.relative_to(nbu.REPO)))
        _run_cell(page, 0)
        _wait(page, "the cluster did not start", lambda: "2 ranks up" in _outputs(page, 0), 180)

        bug = page.locator(".jp-NotebookPanel-toolbar .jp-DebuggerBugButton").first
        bug.click()
        _wait(page, "the debugger did not switch on",
              lambda: page.locator(".jp-Notebook .cm-breakpoint-gutter").count() > 0, 30)
        # the debugger's sidebar, on the right
        tab = page.locator('.jp-SideBar.jp-mod-right .lm-TabBar-tab[data-id="jp-debugger-sidebar"]')
        if tab.count() and "lm-mod-current" not in (tab.first.get_attribute("class") or ""):
            tab.first.click()

        _gutter_click(page, 1, 3)
        page.wait_for_timeout(1000)  # the setBreakpoints round trip
        _run_cell(page, 1)

        frames = page.locator(".jp-DebuggerCallstackFrame")
        _wait(page, "the Callstack panel showed no rank",
              lambda: frames.count() >= 2, 60)
        names = frames.all_inner_texts()
        assert any(re.search(r"rank 0 · <module>.*3", n, re.S) for n in names), names
        assert any(re.search(r"rank 1 · <module>.*3", n, re.S) for n in names), names
        variables = page.locator(".jp-DebuggerVariables")
        _wait(page, "the Variables panel showed no x",
              lambda: re.search(r"\bx:?\s*(0|10)\b", variables.inner_text() or "") is not None, 30,
              lambda: repr(variables.inner_text()))
        _screenshot(page, shot)

        # one Continue moves every stopped rank (Lab's Continue names another thread
        # than the one it shows: dpnb.session.dap.DapRouter._continue_all)
        page.get_by_title(re.compile(r"^Continue")).first.click()
        _wait(page, "the cell did not finish after Continue",
              lambda: "[rank 1]" in _outputs(page, 1) and "11" in _outputs(page, 1), 60)
        out = _outputs(page, 1)
        assert "[rank 0]\n1\n" in out + "\n" and "[rank 1]\n11" in out, out

        # a reload: JupyterLab finds the kernel's debugger on, with its breakpoint
        page.reload()
        _open_notebook(page, base, token, str(nb_file.relative_to(nbu.REPO)), goto=False)
        _run_cell(page, 1)
        _wait(page, "after a reload, the Callstack panel showed no rank",
              lambda: sum("rank" in n for n in frames.all_inner_texts()) >= 2, 60,
              lambda: repr(frames.all_inner_texts()))
        page.get_by_title(re.compile(r"^Continue")).first.click()
        _wait(page, "after a reload, the cell did not finish after Continue",
              lambda: "[rank 1]" in _outputs(page, 1) and "11" in _outputs(page, 1), 60)
    except BaseException:
        _screenshot(page, nbu.ARTIFACTS / "browser" / "lab-debugger-failure.png")
        raise
    finally:
        page.close()

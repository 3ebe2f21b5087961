"""``dpnb course build DIR``: the course executed once, as HTML a reader can
open without running anything.

Each chapter runs top to bottom in a fresh kernel (the notebook's own, the
default ``python3``; every chapter loads dpnb and starts and stops its own
two CPU engines), in the notebooks' folder, exactly as a learner's Run All
would.  The executed notebook is exported with nbconvert: the figures are in
the page as images (every dpnb view shows a static copy beside its widget),
the widgets' saved state lets them render where the page can load the
widget scripts, and the check questions show without their answers.  A
chapter that fails is still written (its error is in the page) and is named
in ``index.html`` and in the return value; the others are built regardless.
"""

from __future__ import annotations

import html
import logging
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Built:
    chapter: str
    html: Path
    seconds: float
    error: str | None  # the failing cell's error, if one failed


def chapters(notebooks: Path, only: list[str] | None = None) -> list[Path]:
    """The chapter notebooks (``NN_name.ipynb``), all or those whose number is in ``only``."""
    found = sorted(p for p in Path(notebooks).glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise FileNotFoundError(f"no chapter notebooks (NN_name.ipynb) in {notebooks}: give "
                                f"--notebooks, the course's notebooks/ folder")
    if only:
        missing = [o for o in only if not any(p.name.startswith(o + "_") for p in found)]
        if missing:
            raise ValueError(f"no chapter {', '.join(missing)} in {notebooks} "
                             f"(chapters: {', '.join(p.name[:2] for p in found)})")
        found = [p for p in found if p.name[:2] in only]
    return found


def build_one(path: Path, out_dir: Path, timeout: int = 300) -> Built:
    """Execute one chapter and write ``out_dir/NN_name.html``."""
    # lazy: only building the course runs notebooks
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from nbconvert import HTMLExporter

    nb = nbformat.read(path, as_version=4)
    t0 = time.monotonic()
    error = None
    client = NotebookClient(nb, timeout=timeout, allow_errors=False, store_widget_state=True,
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as e:  # the page still shows what ran, with the error
        error = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        log.warning("chapter %s failed: %s", path.name, error)
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    out = out_dir / (path.stem + ".html")
    out.write_text(body, encoding="utf-8")
    return Built(path.stem, out, time.monotonic() - t0, error)


def build(out_dir: str | Path, notebooks: str | Path = "notebooks",
          only: list[str] | None = None, timeout: int = 300) -> list[Built]:
    """Build every (or each ``only``) chapter into ``out_dir``, plus ``index.html``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = [build_one(p, out, timeout) for p in chapters(Path(notebooks), only)]
    rows = "\n".join(
        f'<li><a href="{html.escape(b.html.name)}">{html.escape(b.chapter)}</a> '
        f'({b.seconds:.0f} s{", <b>failed</b>: " + html.escape(b.error) if b.error else ""})</li>'
        for b in done)
    (out / "index.html").write_text(
        "<!doctype html><meta charset='utf-8'><title>dpnb course</title>"
        f"<h1>dpnb: data parallelism, the course (executed)</h1><ul>{rows}</ul>\n",
        encoding="utf-8")
    return done

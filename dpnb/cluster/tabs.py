"""Per-rank tabs: what each rank printed, one tab per distinct output.

When every rank prints the same thing, one grouped block says it (see
:mod:`.render`).  When they differ, or print a lot, a block per group
buries the one rank that matters under the others.  In a Jupyter kernel
the output then becomes an ``ipywidgets.Tab``: first the folded
``[all N ranks]`` view (identical output shown once, labelled), then one tab
per distinct output -- ``rank 3``, or ``ranks 0-2,4-7`` for ranks that
agree -- updated in place while the cell runs.  The widget's ``text/plain``
is the folded text, so a saved notebook, nbconvert and a terminal show
exactly what they showed before.
"""

from __future__ import annotations

import html
import logging

from ..ranks import rank_label
from .diagnose import group_identical

log = logging.getLogger(__name__)

#: more lines than this on one rank, and the output goes into tabs even if
#: every rank printed the same
LONG_LINES = 40
#: a tab shows at most the last this many lines (a cell printing a million
#: lines must not freeze the browser)
TAB_MAX_LINES = 2000


def wants_tabs(texts: dict[int, str], running: bool = False) -> bool:
    """Whether ``{rank: text}`` is worth tabs: ranks differ, or one printed a lot.

    ``running``: the cell is still going, so a rank whose output is a prefix
    of another's is only behind, not different.
    """
    nonempty = {r: t for r, t in texts.items() if t}
    if not nonempty:
        return False
    if any(t.count("\n") > LONG_LINES for t in nonempty.values()):
        return True
    # ranks that print nothing do not count: `if rank == 0: print(...)` reads
    # fine as one labelled block
    distinct = {t for _, t in group_identical(nonempty)}
    if running:
        longest = max(distinct, key=len)
        return not all(longest.startswith(t) for t in distinct)
    return len(distinct) > 1


def tab_items(texts: dict[int, str], folded: str) -> list[tuple[str, str]]:
    """``[(title, text), ...]``: the folded view, then one per distinct output."""
    world = len(texts)
    items = [(f"[all {world} ranks]" if world > 1 else "[rank 0]", folded)]
    nonempty = {r: t for r, t in texts.items() if t}
    items += [(rank_label(ranks), text) for ranks, text in group_identical(nonempty)]
    silent = sorted(set(texts) - set(nonempty))
    if silent:
        items.append((rank_label(silent), "(printed nothing)"))
    return items


def _pre(text: str) -> str:
    lines = text.splitlines()
    if len(lines) > TAB_MAX_LINES:
        text = f"... ({len(lines) - TAB_MAX_LINES} earlier lines not shown)\n" + "\n".join(
            lines[-TAB_MAX_LINES:])
    return ("<pre style='margin:0;max-height:32em;overflow:auto;white-space:pre-wrap'>"
            f"{html.escape(text)}</pre>")


class RankTabs:
    """The tab widget of one cell's output, updated as the ranks print."""

    def __init__(self):
        # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
        import ipywidgets as w

        self._w = w
        self.tab = w.Tab()
        self.tab.add_class("dpnb-rank-tabs")
        self.panes: list = []
        self.titles: list[str] = []
        self.folded = ""

    def update(self, texts: dict[int, str], folded: str) -> None:
        items = tab_items(texts, folded)
        self.folded = folded
        while len(self.panes) < len(items):
            self.panes.append(self._w.HTML())
        titles = [t for t, _ in items]
        if titles != self.titles or len(self.tab.children) != len(items):
            self.tab.children = tuple(self.panes[:len(items)])
            self.tab.titles = tuple(titles)
            self.titles = titles
        for pane, (_, text) in zip(self.panes, items):
            value = _pre(text)
            if pane.value != value:
                pane.value = value

    def bundle(self) -> dict:
        """The widget's display data, with the folded text as its plain-text form."""
        data = self.tab._repr_mimebundle_()
        if isinstance(data, tuple):  # (data, metadata) from some ipywidgets versions
            data = data[0]
        return {**data, "text/plain": self.folded or "(no output)"}


def make() -> RankTabs | None:
    """A tab widget, or None where ipywidgets cannot be imported (text then)."""
    try:
        return RankTabs()
    except ImportError as e:
        log.info("per-rank tabs off, ipywidgets not importable: %s", e)
        return None

"""Streamed output: every line shown is one whole line of one rank.

A rank's stdout and stderr arrive as separate growing texts (ipyparallel
keeps each), in chunks that can end mid-line: ``print`` writes its text and
its newline separately and the engine's stream may be flushed between them.
The streamer used to show ``stdout + stderr`` as one text, so a line still
being printed ran into the first line of stderr ("a 2warn"), and the
terminal view's offsets into that joined text, once stdout grew, skipped or
split lines.  Fakes stand in for ipyparallel's results; only their raw
metadata (what ``compat.result_metadata`` reads) is set.
"""

import IPython.display

from dpnb.cluster import render


class _AR:
    def __init__(self):
        self._metadata = [{"stdout": "", "stderr": "", "outputs": []}]

    def grow(self, stdout="", stderr=""):
        self._metadata[0]["stdout"] += stdout
        self._metadata[0]["stderr"] += stderr


def _two_ranks():
    ars = {0: _AR(), 1: _AR()}
    s = render.Streamer(ars, delay_s=0, min_interval_s=0)
    return ars, s


def _feed(ars, s):
    """Two ranks, each mid-line on stdout while stderr has a whole line, then the rest."""
    for r, ar in ars.items():
        ar.grow(stdout=f"rank {r} a 1\nrank {r} a 2", stderr=f"rank {r} warn\n")
    s.poll()
    for r, ar in ars.items():
        ar.grow(stdout="\n" + "".join(f"rank {r} a {i}\n" for i in range(3, 6)))
    s.poll()
    s.close()


EXPECTED = {f"rank {r} {x}" for r in (0, 1) for x in ("a 1", "a 2", "a 3", "a 4", "a 5", "warn")}


def test_terminal_stream_prints_each_line_of_each_rank_whole_and_once(capsys):
    ars, s = _two_ranks()
    s._kernel = False
    _feed(ars, s)
    lines = capsys.readouterr().out.splitlines()
    assert lines, "nothing streamed"
    for line in lines:
        prefix, _, text = line.partition("] ")
        assert prefix in ("[rank 0", "[rank 1") and text.startswith(prefix[1:]), line
    texts = [ln.partition("] ")[2] for ln in lines]
    assert sorted(texts) == sorted(EXPECTED), texts  # each once: none split, skipped or repeated


def test_jupyter_live_area_shows_no_line_run_into_another(monkeypatch):
    shown = []

    class Handle:
        def update(self, data, raw=False):
            shown.append(data)

    def fake_display(data, raw=False, display_id=False):
        shown.append(data)
        return Handle()

    monkeypatch.setattr(IPython.display, "display", fake_display)
    ars, s = _two_ranks()
    s._kernel = True
    s.poll()  # nothing printed yet: nothing shown
    for r, ar in ars.items():
        ar.grow(stdout=f"rank {r} a 1\nrank {r} a 2", stderr=f"rank {r} warn\n")
    s.poll()
    assert shown, "nothing streamed"
    for data in shown:
        for line in data["text/plain"].splitlines():
            assert line in EXPECTED or line.startswith("[") or line == "...", line

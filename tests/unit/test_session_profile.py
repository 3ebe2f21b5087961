"""dpnb.session.profile's bookkeeping with a stand-in cluster: whatever the code does
(raise, Ctrl-C), every rank's profiler is stopped and the profile kept."""

import gzip
import json
import types

import pytest

from dpnb.core import profile as P
from dpnb.session import profile as SP


class _Fake:
    world_size = 2

    def __init__(self):
        self.calls = []
        self.last_profile = "stale"

    def require_running(self):
        pass

    def call(self, dotted, *args, ranks=None, raise_errors=True):
        self.calls.append(dotted.rsplit(".", 1)[1])
        ok = types.SimpleNamespace(ok=True, value=None, ename="", evalue="")
        if dotted.endswith(".end"):
            ev = [{"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 0, "dur": 5, "tid": 1}]
            outs = {}
            for r in range(2):
                blob = gzip.compress(json.dumps({"traceEvents": ev}).encode())
                outs[r] = types.SimpleNamespace(ok=True, value=(P.extract(ev, rank=r, host="h"), blob),
                                                ename="", evalue="")
            return types.SimpleNamespace(outcomes=outs)
        return types.SimpleNamespace(outcomes={0: ok, 1: ok})


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), ValueError("boom\nmore")])
def test_the_profilers_stop_and_the_profile_is_kept_whatever_the_code_raised(exc, tmp_path):
    c = _Fake()

    def run():
        raise exc

    with pytest.raises(type(exc)):
        SP.profiled(c, run, out_dir=str(tmp_path))
    assert c.calls == ["begin", "end"]
    p = c.last_profile
    assert p.failure == ("KeyboardInterrupt" if isinstance(exc, KeyboardInterrupt) else "boom")
    assert any("failed" in n for n in p.report.notes)
    assert p.wait(10) and p.writing.error == ""
    assert (tmp_path / "rank1.json").is_file() and json.loads((tmp_path / "merged.json").read_text())


def test_the_result_returns_before_the_trace_files_are_written(tmp_path, monkeypatch):
    """The analysis is ready when the call returns; unpacking the traces and
    building the merged one happen after, on a thread of their own."""
    import threading
    import time

    gate = threading.Event()
    real = SP.merged_trace

    def slow_merge(report, traces):  # the merged trace waits for the test's word
        gate.wait(10)
        return real(report, traces)

    monkeypatch.setattr(SP, "merged_trace", slow_merge)
    c = _Fake()
    t0 = time.monotonic()
    assert SP.profiled(c, lambda: "result", out_dir=str(tmp_path))[0] == "result"
    assert time.monotonic() - t0 < 5
    p = c.last_profile
    assert p.report.ranks and p.files == ("merged.json", "rank0.json", "rank1.json")
    assert not (tmp_path / "merged.json").exists() and not p.wait(0.05)
    gate.set()
    assert p.wait(10) and json.loads((tmp_path / "merged.json").read_text())["traceEvents"]
    gate.clear()  # wait=True: the files are there when the call returns
    threading.Timer(0.3, gate.set).start()
    SP.profiled(c, lambda: None, out_dir=str(tmp_path / "w"), wait=True)
    assert (tmp_path / "w" / "merged.json").is_file()


def test_engines_are_armed_once_and_a_replaced_one_again(caplog):
    """The profiling hook is registered by a call on an engine's first profiled
    cell; engines are remembered by PID, so one that replaced a rank is armed again."""
    class _Ranked(_Fake):
        def __init__(self):
            super().__init__()
            self.ranks = [types.SimpleNamespace(rank=0, pid=100), types.SimpleNamespace(rank=1, pid=101)]
            self.dead, self.profile_armed, self.asked, self.refuse = {}, set(), [], set()

        def call(self, dotted, *args, ranks=None, raise_errors=True):
            self.asked.append(list(ranks))
            outs = {r: types.SimpleNamespace(ok=r not in self.refuse, value=r not in self.refuse,
                                             ename="RuntimeError", evalue="no shell")
                    for r in ranks}
            return types.SimpleNamespace(outcomes=outs)

    c = _Ranked()
    SP._arm(c)
    SP._arm(c)
    assert c.asked == [[0, 1]] and c.profile_armed == {100, 101}
    c.ranks[1] = types.SimpleNamespace(rank=1, pid=202)  # a restart replaced rank 1
    c.refuse = {1}
    SP._arm(c)
    assert c.asked[-1] == [1] and 202 not in c.profile_armed
    assert "profiling hook not registered on rank 1: RuntimeError: no shell" in caplog.text
    c.refuse = set()
    SP._arm(c)  # tried again on the next profiled cell
    assert c.asked[-1] == [1] and 202 in c.profile_armed


def test_a_profiled_cells_ends_come_home_in_its_replies_and_only_the_rest_are_asked(tmp_path):
    """A profiled cell's ranks end their profilers as the cell ends and send the
    records in the cell's own replies: no call after the cell for them.  A rank
    whose reply carried nothing (its cell failed) is asked with the end call; a
    trace too big for its reply is taken with one call."""
    from dpnb.cluster.types import CellResult, RankOutcome, Status
    from dpnb.core.cellflags import PROFILE_CARRY, carry_text

    ev = [{"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 0, "dur": 5, "tid": 1}]
    blob = gzip.compress(json.dumps({"traceEvents": ev}).encode())

    def carry(r, kept):
        rec = P.extract(ev, rank=r, host="h")
        return {PROFILE_CARRY: carry_text((rec, None if kept else blob, kept))}

    class _Cell(_Fake):
        world_size = 3

        def __init__(self):
            super().__init__()
            self.asked = []
            self.ranks = [types.SimpleNamespace(rank=r, pid=100 + r) for r in range(3)]
            self.dead, self.profile_armed = {}, set()

        def call(self, dotted, *args, ranks=None, raise_errors=True):
            self.asked.append((dotted.rsplit(".", 1)[1], list(ranks)))
            if dotted.endswith(".take"):
                return types.SimpleNamespace(outcomes={r: RankOutcome(r, Status.OK, blob) for r in ranks})
            outs = {r: RankOutcome(r, Status.OK, (P.extract(ev, rank=r, host="h"), blob)) for r in ranks}
            return types.SimpleNamespace(outcomes=outs)

    c = _Cell()
    outs = {0: RankOutcome(0, Status.OK, carry=carry(0, False)),
            1: RankOutcome(1, Status.OK, carry=carry(1, True)), 2: RankOutcome(2, Status.OK)}
    cell = CellResult(ranks=[0, 1, 2], outcomes=outs, elapsed_s=0.0)
    SP.profiled(c, lambda tag: cell, out_dir=str(tmp_path), in_request=True, wait=True)
    assert c.asked == [("arm", [0, 1, 2]), ("end", [2]), ("take", [1])]
    p = c.last_profile
    assert [r.rank for r in p.report.ranks] == [0, 1, 2] and p.writing.error == ""
    assert p.files == ("merged.json", "rank0.json", "rank1.json", "rank2.json")
    assert json.loads((tmp_path / "rank1.json").read_text())["traceEvents"] == ev

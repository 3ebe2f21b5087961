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
    assert (tmp_path / "rank1.json").is_file() and json.loads((tmp_path / "merged.json").read_text())

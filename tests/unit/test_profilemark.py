"""Flags a cell travels with (dpnb.core.cellflags): ``%%dp --profile`` told in the
cell's own request, read by each rank's hook (dpnb.engine.metrics.profilemark)."""

import pytest

from dpnb.core.cellflags import (UNCHECKED_FLAG, profile_flag, profile_tag, trailing_flags,
                                 with_flags)
from dpnb.engine.cell.collcheck import is_unchecked


class _Info:
    def __init__(self, raw):
        self.raw_cell = raw


def test_the_tag_travels_after_the_cell_beside_the_unchecked_flag():
    cell = "x = 1\nprint(x)"
    sent = with_flags(cell, (profile_flag("20261128-171700-ab12cd"),))
    assert sent.startswith(cell + "\n") and profile_tag(sent) == "20261128-171700-ab12cd"
    both = with_flags(cell, (profile_flag("20261128-171700-ab12cd"), UNCHECKED_FLAG))
    assert profile_tag(both) == "20261128-171700-ab12cd" and is_unchecked(_Info(both))
    assert with_flags(cell, ()) == cell and not is_unchecked(_Info(sent))
    # the user's own lines never count: only the trailing ones, and a well-formed tag
    assert profile_tag(cell) is None and trailing_flags(None) == []
    assert profile_tag("# dpnb: --profile t1\n" + "x = 1\n" * 5) is None
    assert profile_tag(cell + "\n# dpnb: --profile ../../etc") is None
    with pytest.raises(ValueError, match="letters, digits"):
        profile_flag("a/b")

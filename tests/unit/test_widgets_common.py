"""Shared plumbing: units, tables, static bundle, show() outside a kernel, save()."""

import base64

import pytest

from dpnb.widgets import VIEWS, ViewError, _common as C, memory


def test_units():
    assert C.fmt_bytes(999) == "999 B"
    assert C.fmt_bytes(1.5e9) == "1.5 GB"
    assert C.fmt_bytes(3 * 2**30, binary=True) == "3 GiB"
    assert C.byte_scale(5e6) == (1e6, "MB")
    assert C.unit_note("GB") == "GB = 10⁹ B"
    assert C.fmt_ms(0.0123) == "12.3 ms"
    assert C.fmt_count(7e9) == "7 bn" and C.fmt_count(1.25e8) == "125 M"
    assert C.fmt_signed_bytes(28) == "+28 B" and C.fmt_signed_bytes(0) == "0 B"
    assert C.log_sizes(1e3, 1e6, 4) == [1000, 10000, 100000, 1000000]


def test_tables():
    t = C.text_table(["a", "bb"], [[1, 22], [333, 4]])
    assert t.splitlines()[0] == "  a  bb" and t.splitlines()[2] == "  1  22"
    h = C.html_table(["x"], [["<y>"]], "cap")
    assert "&lt;y&gt;" in h and "<caption" in h


def test_static_bundle_survives_without_widgets():
    fig = memory.figure(memory.data())
    b = C.static_bundle(fig, "<p>t</p>", "text")
    assert base64.b64decode(b["image/png"])[:4] == b"\x89PNG"
    assert b["text/html"].startswith("<div class='dpnb-static'><img src='data:image/png;base64,")
    assert b["text/plain"] == "text"


def test_show_prints_text_outside_a_kernel(capsys):
    memory.show(n_params=1e9, dp=4)
    out = capsys.readouterr().out
    assert out.startswith("ZeRO memory per rank") and "ZeRO-3" in out


def test_save_rejects_other_formats(tmp_path):
    with pytest.raises(ViewError, match=".png or .svg"):
        memory.save(str(tmp_path / "m.jpg"))


def test_every_view_module_has_the_api():
    import importlib

    for name in VIEWS:
        mod = importlib.import_module(f"dpnb.widgets.{name}")
        for fn in ("data", "figure", "text", "html", "view", "show", "save"):
            assert callable(getattr(mod, fn)), f"{name}.{fn}"

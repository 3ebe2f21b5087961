"""The course's "numbers quoted elsewhere" boxes: each corrected value is what
dpnb.core computes, and the boxes are in their chapters."""

import json

import pytest

from dpnb.core import zero_memory
from helpers.nbutil import REPO

GB = 1e9


def _markdown(chapter: str) -> str:
    nb = json.loads((REPO / "notebooks" / f"{chapter}.ipynb").read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


def test_memory_figures_in_chapter_05():
    m70, m10 = zero_memory(70e9, 1, 0), zero_memory(10e9, 1, 0)
    assert m70.optimizer_moments == pytest.approx(560 * GB)  # not 280 GB
    assert m70.master_weights == pytest.approx(280 * GB)
    assert m70.total == pytest.approx(1.12e12)  # not 1.4 TB
    assert m10.optimizer_states == pytest.approx(120 * GB) and m10.total == pytest.approx(160 * GB)
    assert 80 * GB / m10.bytes_per_param == pytest.approx(5e9)  # not ~30B
    for n in (2, 8, 64):
        assert zero_memory(1.0, n, 1).total == pytest.approx(4 + 12 / n)  # not 8 + 4/N
    md = _markdown("05_zero1")
    for s in ("**560 GB**", "**120 GB, total 160 GB**", "**1.12 TB**", "**about 5B on an 80 GB GPU**",
              "**4P + 12P/N**"):
        assert s in md, s


def test_sharding_figures_in_chapter_06():
    for n in (2, 8, 64):
        assert zero_memory(1.0, n, 2).total == pytest.approx(2 + 14 / n)  # not 4 + 8/N
        assert zero_memory(1.0, n, 3).total == pytest.approx(16 / n)  # not "as low as 2"
    ratio = {(n, s): 16 / zero_memory(1.0, n, s).total for n in (8, 64) for s in (1, 2)}
    assert [round(ratio[k], 1) for k in sorted(ratio)] == [2.9, 4.3, 3.8, 7.2]
    md = _markdown("06_zero2_zero3_fsdp")
    for s in ("**2P + 14P/N**", "**16/N bytes**", "2.9× and 4.3× at N = 8, 3.8× and 7.2× at N = 64"):
        assert s in md, s


def test_scaling_efficiency_figures_in_chapter_08():
    from dpnb.core import LINKS, collective_time, scaling

    def eff(link, overlap):
        comm = lambda n: collective_time("all_reduce", 2e9, n, LINKS[link])  # noqa: E731
        return round(100 * scaling([8], 0.2, comm, overlap=overlap)[0].efficiency)

    assert [eff(k, 0.6) for k in ("nvlink4-h100", "ib-ndr-400", "pcie-gen4-x16", "ethernet-100g")] == [98, 88, 78, 64]
    assert [eff(k, 0.0) for k in ("pcie-gen4-x16", "ethernet-100g")] == [59, 42]
    md = _markdown("08_scaling_and_stragglers")
    for s in ("**a property of the job, not of DDP**", "98 % on NVLink, 88 % on IB NDR and 64 % on 100 Gb Ethernet",
              "78 % on PCIe Gen4 with 60 % overlap, 59 % without", "64 % and 42 %"):
        assert s in md, s

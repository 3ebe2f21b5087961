"""Analytic ZeRO memory model: published figures and invariants."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpnb.core import (
    GB,
    TB,
    ConfigError,
    bytes_per_param_parts,
    max_params_that_fit,
    memory_table,
    min_dp_to_fit,
    zero_memory,
)
from dpnb.core.memory import MODELED_OPTIMIZERS as OPTIMIZERS, OFFLOADS, PRECISIONS

SETTINGS = settings(max_examples=150, deadline=None)
H100_BYTES = 80 * GB  # the "80 GB" of an H100 SXM, decimal as quoted

precisions = st.sampled_from(PRECISIONS)
optimizers = st.sampled_from(OPTIMIZERS)
n_params = st.integers(1, 10**12)
dps = st.integers(1, 4096)


def test_mixed_precision_adam_is_16_bytes_per_param_unsharded() -> None:
    for dp in (1, 8, 1024):
        m = zero_memory(10**9, dp, 0, "bf16-mixed", "adam")
        assert m.bytes_per_param == 16
        assert (m.params, m.grads, m.master_weights, m.optimizer_moments) == (2e9, 2e9, 4e9, 8e9)
    assert zero_memory(10**9, 1, 0, "fp16-mixed", "adamw").bytes_per_param == 16


@SETTINGS
@given(psi=n_params, n=dps)
def test_zero_stage_formulas(psi: int, n: int) -> None:
    # Rajbhandari et al. 2020, Figure 1: K = 12 for mixed-precision Adam.
    z = [zero_memory(psi, n, s).total for s in range(4)]
    assert z[0] == pytest.approx(16 * psi)
    assert z[1] == pytest.approx(2 * psi + 2 * psi + 12 * psi / n)
    assert z[2] == pytest.approx(2 * psi + 14 * psi / n)
    assert z[3] == pytest.approx(16 * psi / n)


def test_seed_zero1_zero2_formulas_are_wrong() -> None:
    # A seed text quotes ZeRO-1 as "~8P + 4P/N" and ZeRO-2 as "~4P + 8P/N"; both
    # contradict the paper (only the fp16 params and grads stay replicated).
    psi, n = 10**9, 8
    assert zero_memory(psi, n, 1).total == pytest.approx(4 * psi + 12 * psi / n)
    assert zero_memory(psi, n, 1).total != pytest.approx(8 * psi + 4 * psi / n)
    assert zero_memory(psi, n, 2).total != pytest.approx(4 * psi + 8 * psi / n)


def test_7b_dp8_optimizer_moments_56gb_to_7gb_under_zero1() -> None:
    z0 = zero_memory(7e9, 8, 0)
    z1 = zero_memory(7e9, 8, 1)
    # The 56 GB counts Adam's two fp32 moments (8 B/param), not the master weights.
    assert z0.optimizer_moments == pytest.approx(56 * GB)
    assert z1.optimizer_moments == pytest.approx(7 * GB)
    assert (z1.params, z1.grads) == (pytest.approx(14 * GB), pytest.approx(14 * GB))
    assert z0.total == pytest.approx(112 * GB)  # "~112 GB just for the model state"
    # With master weights the optimizer states are 84 GB → 10.5 GB.
    assert (z0.optimizer_states, z1.optimizer_states) == (pytest.approx(84 * GB), pytest.approx(10.5 * GB))
    assert zero_memory(7e9, 8, 3).total == pytest.approx(14 * GB)


def test_10b_mixed_precision_does_not_fit_an_h100() -> None:
    m = zero_memory(10e9, 1, 0, "bf16-mixed", "adam")
    assert m.params == pytest.approx(20 * GB)
    assert m.grads == pytest.approx(20 * GB)
    # The seed table says 60 GB of optimizer states (fp32 master + momentum + variance)
    # for a total of 100 GB; 3 × 4 B × 10e9 is 120 GB, so the total is 160 GB.
    # Either way the conclusion stands: it does not fit 80 GB.
    assert m.optimizer_states == pytest.approx(120 * GB)
    assert m.total == pytest.approx(160 * GB)
    assert not m.fits(H100_BYTES)


def test_70b_mixed_adam_is_1_1_to_1_4_tb() -> None:
    low = zero_memory(70e9, 1, 0, "bf16-mixed", "adam")  # 16 B/param: the ZeRO count
    high = zero_memory(70e9, 1, 0, "fp16-mixed", "adam", fp32_grad_accum=True)  # + fp32 grad buffer: 20 B
    assert low.total == pytest.approx(1.12 * TB)
    assert high.total == pytest.approx(1.40 * TB)
    assert high.bytes_per_param == 20
    for m in (low, high):
        assert 1.1 * TB <= m.total <= 1.4 * TB + 1
    # The moments alone are 560 GB ("140B optimizer state" in 4-byte words).
    assert low.optimizer_moments == pytest.approx(560 * GB)


def test_70b_zero3_dp64_fits() -> None:
    m = zero_memory(70e9, 64, 3)
    assert m.total == pytest.approx(17.5 * GB) and m.fits(H100_BYTES)
    assert min_dp_to_fit(70e9, H100_BYTES, 3) == 14


def test_bytes_per_param_parts_table() -> None:
    assert sum(bytes_per_param_parts("fp32", "adam").values()) == 16
    assert sum(bytes_per_param_parts("bf16-mixed", "sgd-momentum").values()) == 12
    assert sum(bytes_per_param_parts("bf16-mixed", "sgd").values()) == 8
    assert sum(bytes_per_param_parts("fp32", "sgd").values()) == 8
    assert bytes_per_param_parts("fp32", "adam", fp32_grad_accum=True)["grad_accum"] == 0
    with pytest.raises(ConfigError, match="precision"):
        bytes_per_param_parts("fp8")  # type: ignore[arg-type]


@SETTINGS
@given(psi=n_params, n=dps, prec=precisions, opt=optimizers, acc=st.booleans(), off=st.sampled_from(OFFLOADS[:2]))
def test_memory_monotone_in_stage(psi: int, n: int, prec: str, opt: str, acc: bool, off: str) -> None:
    rows = memory_table(psi, n, prec, opt, fp32_grad_accum=acc, offload=off)  # type: ignore[arg-type]
    totals = [r.total for r in rows]
    assert all(a >= b * (1 - 1e-12) for a, b in zip(totals, totals[1:]))
    for part in ("params", "grads", "grad_accum", "master_weights", "optimizer_moments"):
        vals = [getattr(r, part) for r in rows]
        assert all(a >= b * (1 - 1e-12) for a, b in zip(vals, vals[1:]))


@SETTINGS
@given(psi=n_params, n=dps, prec=precisions, opt=optimizers, acc=st.booleans())
def test_zero3_times_n_equals_stage0(psi: int, n: int, prec: str, opt: str, acc: bool) -> None:
    z0 = zero_memory(psi, n, 0, prec, opt, fp32_grad_accum=acc)  # type: ignore[arg-type]
    z3 = zero_memory(psi, n, 3, prec, opt, fp32_grad_accum=acc)  # type: ignore[arg-type]
    assert z3.total * n == pytest.approx(z0.total, rel=1e-12)
    assert z0.bytes_per_param == pytest.approx(sum(bytes_per_param_parts(prec, opt, acc).values()))  # type: ignore[arg-type]


@SETTINGS
@given(psi=n_params, n=dps, stage=st.sampled_from([0, 1, 2, 3]), off=st.sampled_from(OFFLOADS))
def test_offload_conserves_bytes(psi: int, n: int, stage: int, off: str) -> None:
    if off == "optimizer+params" and stage != 3:
        with pytest.raises(ConfigError, match="stage 3"):
            zero_memory(psi, n, stage, offload=off)  # type: ignore[arg-type]
        return
    base = zero_memory(psi, n, stage)
    m = zero_memory(psi, n, stage, offload=off)  # type: ignore[arg-type]
    assert m.total + m.host_total == pytest.approx(base.total)
    if off != "none":
        assert m.master_weights == m.optimizer_moments == 0
        assert m.host_optimizer_moments == pytest.approx(base.optimizer_moments)


def test_max_params_that_fit_h100() -> None:
    assert max_params_that_fit(H100_BYTES, 1, 0) == 5_000_000_000
    assert max_params_that_fit(H100_BYTES, 8, 3) == 40_000_000_000
    assert max_params_that_fit(H100_BYTES, 8, 1) == 80 * GB * 2 // 11  # 4 + 12/8 = 5.5 B/param
    assert max_params_that_fit(H100_BYTES, 8, 0, reserved_bytes=16 * GB) == 4_000_000_000
    assert max_params_that_fit(1.0, 8, 0, reserved_bytes=2.0) == 0


@SETTINGS
@given(
    cap=st.integers(10**6, 10**12), n=dps, stage=st.sampled_from([0, 1, 2, 3]), prec=precisions,
    opt=optimizers, off=st.sampled_from(OFFLOADS[:2]),
)
def test_max_params_is_tight(cap: int, n: int, stage: int, prec: str, opt: str, off: str) -> None:
    kw = {"precision": prec, "optimizer": opt, "offload": off}
    psi = max_params_that_fit(cap, n, stage, **kw)  # type: ignore[arg-type]
    assert zero_memory(psi, n, stage, **kw).total <= cap * (1 + 1e-12)  # type: ignore[arg-type]
    assert zero_memory(psi + 1, n, stage, **kw).total > cap * (1 - 1e-12)  # type: ignore[arg-type]


def test_min_dp_to_fit_explains_when_impossible() -> None:
    with pytest.raises(ConfigError) as err:
        min_dp_to_fit(70e9, H100_BYTES, 1)
    assert "280 GB" in str(err.value) and "stage" in str(err.value)
    assert min_dp_to_fit(1e9, H100_BYTES, 0) == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"n_params": 1e9, "dp": 0, "stage": 0}, "dp"),
        ({"n_params": 1e9, "dp": 8, "stage": 4}, "stage"),
        ({"n_params": -1.0, "dp": 8, "stage": 0}, "n_params"),
        ({"n_params": 1e9, "dp": 8, "stage": 0, "optimizer": "lion"}, "optimizer"),
    ],
)
def test_zero_memory_validates(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        zero_memory(**kwargs)


def test_describe_mentions_gb() -> None:
    assert "GB" in zero_memory(7e9, 8, 1).describe()

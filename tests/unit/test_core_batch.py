"""Batch arithmetic, LR scaling and DP × TP × PP factoring."""

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpnb.core import BatchConfig, ConfigError, Parallelism, factor_world, scale_lr, solve_dp, solve_grad_accum

SETTINGS = settings(max_examples=150, deadline=None)


def test_4m_tokens_at_4096_is_1024_samples_and_grad_accum_32() -> None:
    # "4M tokens" in the source is 4 Mi = 2**22 tokens: only that is a whole number of 4096-token samples.
    sol = solve_grad_accum(4, 8, target_tokens=4 * 2**20, seq_len=4096)
    assert sol.exact
    assert sol.grad_accum == 32
    assert sol.config.global_samples == 1024
    assert sol.config.global_tokens == 4 * 2**20
    assert "1,024 samples" in sol.message and "= 32" in sol.message
    assert solve_grad_accum(4, 8, target_samples=1024).grad_accum == 32


def test_dp16_mb2_ga4_seq4096_is_524288_tokens() -> None:
    cfg = BatchConfig(micro_batch=2, dp=16, grad_accum=4, seq_len=4096)
    assert cfg.global_samples == 128
    assert cfg.global_tokens == 524_288
    assert cfg.per_rank_samples == 8


def test_decimal_4m_tokens_is_not_exact_and_reports_neighbours() -> None:
    sol = solve_grad_accum(4, 8, target_tokens=4_000_000, seq_len=4096)
    assert not sol.exact
    assert sol.lower is not None and sol.lower.grad_accum == 30 and sol.lower.global_tokens == 3_932_160
    assert sol.upper.grad_accum == 31 and sol.upper.global_tokens == 4_063_232
    assert sol.grad_accum == 31  # 63,232 away vs 67,840
    assert "30.5176" in sol.message and "3,932,160" in sol.message and "4,063,232" in sol.message
    with pytest.raises(ConfigError, match="not a whole number"):
        sol.require_exact()


def test_inexact_samples_suggests_exact_alternatives() -> None:
    sol = solve_grad_accum(4, 8, target_samples=1000)
    assert not sol.exact and sol.lower is not None
    assert (sol.lower.global_samples, sol.upper.global_samples) == (992, 1024)
    alts = re.findall(r"micro_batch=(\d+) DP=(\d+) grad_accum=(\d+)", sol.message)
    assert len(alts) >= 2, sol.message  # it does suggest alternatives...
    for mb, dp, ga in alts:  # ...and each one hits the target exactly
        assert int(mb) * int(dp) * int(ga) == 1000


def test_target_below_one_step() -> None:
    sol = solve_dp(4, 8, target_samples=10)
    assert not sol.exact and sol.lower is None and sol.dp == 1
    assert "below 1" in sol.message


def test_solve_dp_exact() -> None:
    sol = solve_dp(2, 4, target_tokens=524_288, seq_len=4096)
    assert sol.exact and sol.dp == 16 and sol.value == 16


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"target_samples": 8, "target_tokens": 8}, {"target_samples": 0}, {"target_samples": 2.5}],
)
def test_solve_rejects_bad_targets(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        solve_grad_accum(1, 1, **kwargs)


def test_batch_config_validates() -> None:
    with pytest.raises(ConfigError, match="micro_batch"):
        BatchConfig(0, 8)
    with pytest.raises(ConfigError, match="dp"):
        BatchConfig(1, True)  # type: ignore[arg-type]


@SETTINGS
@given(
    mb=st.integers(1, 64), dp=st.integers(1, 256), ga=st.integers(1, 128), seq=st.integers(1, 8192),
)
def test_batch_identities_and_round_trip(mb: int, dp: int, ga: int, seq: int) -> None:
    cfg = BatchConfig(mb, dp, ga, seq)
    assert cfg.global_samples == cfg.per_rank_samples * dp == cfg.samples_per_micro_step * ga
    assert cfg.global_tokens == cfg.global_samples * seq
    s = solve_grad_accum(mb, dp, target_tokens=cfg.global_tokens, seq_len=seq)
    assert s.exact and s.config == cfg
    d = solve_dp(mb, ga, target_samples=cfg.global_samples, seq_len=seq)
    assert d.exact and d.config == cfg


@SETTINGS
@given(mb=st.integers(1, 32), dp=st.integers(1, 64), target=st.integers(1, 10**6))
def test_neighbours_bracket_the_target(mb: int, dp: int, target: int) -> None:
    sol = solve_grad_accum(mb, dp, target_samples=target)
    assert sol.upper.global_samples >= target
    if sol.exact:
        assert sol.achieved == target
    else:
        assert sol.upper.global_samples > target
        if sol.lower is not None:
            assert sol.lower.global_samples < target
            assert sol.upper.grad_accum - sol.lower.grad_accum == 1
            assert abs(sol.achieved - target) == min(
                target - sol.lower.global_samples, sol.upper.global_samples - target
            )


def test_scale_lr_rules() -> None:
    assert scale_lr(0.1, 256, 8192, "linear") == pytest.approx(3.2)  # Goyal et al.: 0.1 × k
    assert scale_lr(1e-3, 256, 1024, "sqrt") == pytest.approx(2e-3)
    assert scale_lr(1e-3, 256, 1024, "none") == 1e-3
    with pytest.raises(ConfigError, match="linear"):
        scale_lr(1e-3, 256, 1024, "cubic")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        scale_lr(-1.0, 256, 1024)


@SETTINGS
@given(lr=st.floats(1e-6, 1.0), a=st.integers(1, 10**5), b=st.integers(1, 10**5))
def test_scale_lr_round_trip_and_order(lr: float, a: int, b: int) -> None:
    for rule in ("linear", "sqrt", "none"):
        back = scale_lr(scale_lr(lr, a, b, rule), b, a, rule)  # type: ignore[arg-type]
        assert back == pytest.approx(lr, rel=1e-9)
    if b >= a:
        assert scale_lr(lr, a, b, "linear") >= scale_lr(lr, a, b, "sqrt") >= scale_lr(lr, a, b, "none")


def test_480_gpus_tp8_pp8_does_not_factor() -> None:
    with pytest.raises(ConfigError) as err:
        factor_world(480, tp=8, pp=8)
    msg = str(err.value)
    assert "480 / (8 × 8) = 7.5" in msg
    assert "TP=8 PP=6 → DP=10" in msg
    alts = re.findall(r"TP=(\d+) PP=(\d+) → DP=(\d+)", msg)
    assert len(alts) >= 2
    for tp, pp, dp in alts:
        assert int(tp) * int(pp) * int(dp) == 480


def test_factor_world_ok() -> None:
    par = factor_world(512, tp=8, pp=8)
    assert par == Parallelism(8, 8, 8) and par.world_size == 512
    assert factor_world(8) == Parallelism(8)


@SETTINGS
@given(world=st.integers(1, 4096), tp=st.integers(1, 16), pp=st.integers(1, 16))
def test_factor_world_either_factors_or_explains(world: int, tp: int, pp: int) -> None:
    try:
        par = factor_world(world, tp, pp)
    except ConfigError as e:
        assert world % (tp * pp) != 0
        msg = str(e)
        assert f"{world} / ({tp} × {pp})" in msg
        for t, p, d in re.findall(r"TP=(\d+) PP=(\d+) → DP=(\d+)", msg):
            assert int(t) * int(p) * int(d) == world
    else:
        assert par.dp * tp * pp == world and math.prod((par.dp, par.tp, par.pp)) == world

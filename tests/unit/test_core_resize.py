"""The batch arithmetic of ``%dp resize`` (pure)."""

import math

import pytest

from dpnb.core.errors import ConfigError
from dpnb.core.resize import plan_resize


@pytest.mark.parametrize("b,k,n,m,want", [
    (2, 3, 2, 3, (2, 2)),   # 12 = 2x2x3 = 2x3x2
    (2, 2, 3, 2, (2, 3)),   # back again
    (4, 1, 2, 4, (2, 1)),   # 8 on 4 ranks: grad-accum cannot drop below 1, micro-batch halves
    (8, 1, 4, 2, (8, 2)),   # shrinking doubles the accumulation
    (3, 1, 2, 4, None),     # 6 does not split over 4
])
def test_keep_batch(b, k, n, m, want):
    if want is None:
        with pytest.raises(ConfigError) as e:
            plan_resize(b, k, n, m)
        msg = str(e.value)
        # every factor of the failing arithmetic, and a way out
        assert all(s in msg for s in ("global batch 6", f"micro-batch {b}", f"DP {n}",
                                      f"grad-accum {k}", "4 ranks", "--scale-lr"))
        return
    p = plan_resize(b, k, n, m)
    assert (p.micro_batch, p.grad_accum) == want
    assert p.global_batch == p.old_global_batch == b * n * k and p.lr_factor == 1.0
    assert p.micro_batch <= b  # never more memory per rank
    assert "kept" in p.describe()


def test_keep_lr_scales_with_the_global_batch():
    p = plan_resize(2, 3, 2, 3, keep="lr")
    assert (p.micro_batch, p.grad_accum, p.global_batch) == (2, 3, 18)
    assert p.lr_factor == pytest.approx(1.5)
    assert "global batch 12 -> 18" in p.describe() and "x 1.5" in p.describe()
    assert plan_resize(2, 3, 4, 1, keep="lr", lr_rule="sqrt").lr_factor == pytest.approx(math.sqrt(0.25))


@pytest.mark.parametrize("kw,msg", [(dict(new_dp=0), "new_dp"), (dict(keep="both"), "keep"),
                                    (dict(keep="lr", lr_rule="cubic"), "lr rule")])
def test_bad_arguments(kw, msg):
    args = dict(micro_batch=2, grad_accum=1, old_dp=2, new_dp=3) | kw
    with pytest.raises(ConfigError, match=msg):
        plan_resize(**args)


def test_describe_names_the_rule_that_sets_the_rate():
    p = plan_resize(2, 3, 2, 3, keep="lr")
    ruled = p.describe(lr_rule="--lr-scale sqrt")
    assert ruled.endswith("; the learning rate follows --lr-scale sqrt") and "x 1.5" not in ruled
    assert p.describe(lr_now=0.15).endswith("learning rate x 1.5 (now 0.15)")
    kept = plan_resize(2, 3, 2, 3)
    assert kept.describe(lr_now=0.1) == kept.describe()  # a kept batch leaves the rate alone

"""mean_interval: the per-seed mean with a Student-t 95% interval that the benches print."""

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mentorrl.eval.metrics import mean_interval, t95

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


def test_known_values():
    s = mean_interval([2.0, 4.0, 9.0])
    assert s["mean"] == pytest.approx(5.0)
    assert s["sd"] == pytest.approx(statistics.stdev([2.0, 4.0, 9.0]))
    half = 4.303 * s["sd"] / math.sqrt(3)
    assert s["ci95"] == pytest.approx((5.0 - half, 5.0 + half))
    assert s["verdict"] == "no difference"  # the interval [-4.0, 14.0] holds 0
    assert mean_interval([1.0, 1.1, 0.9])["verdict"] == "higher"
    assert mean_interval([-1.0, -1.1, -0.9])["verdict"] == "lower"


def test_one_value_has_no_interval_and_bad_input_is_refused():
    one = mean_interval([3.0])
    assert one["n"] == 1 and one["sd"] is None and one["ci95"] is None
    with pytest.raises(ValueError):
        mean_interval([])
    with pytest.raises(ValueError):
        mean_interval([1.0, float("nan")])
    with pytest.raises(ValueError):
        t95(0)


@given(st.lists(finite, min_size=2, max_size=40))
def test_interval_is_symmetric_about_the_mean_and_its_verdict_agrees(vals):
    s = mean_interval(vals)
    lo, hi = s["ci95"]
    assert lo <= s["mean"] + 1e-6 * (1 + abs(s["mean"])) and s["mean"] <= hi + 1e-6 * (1 + abs(s["mean"]))
    assert (s["mean"] - lo) == pytest.approx(hi - s["mean"], rel=1e-6, abs=1e-6)
    assert s["verdict"] == ("higher" if lo > 0 else "lower" if hi < 0 else "no difference")


@given(st.integers(min_value=1, max_value=200))
def test_t_quantile_falls_towards_the_normal(dof):
    assert t95(dof) >= 1.96
    if dof > 1:
        assert t95(dof) <= t95(dof - 1)

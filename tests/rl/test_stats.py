import math

import pytest

from lightning_codraft.rl.reports.stats import _t_pdf, paired_difference, t_cdf, t_quantile


def _integrated_cdf(x, df, intervals=20000):
    """The t CDF by Simpson's rule over the density (the definition; what the library computed before)."""
    h = abs(x) / intervals
    s = _t_pdf(0.0, df) + _t_pdf(abs(x), df) + sum((4 if i % 2 else 2) * _t_pdf(i * h, df) for i in range(1, intervals))
    return 0.5 + math.copysign(s * h / 3, x)


def _integrated_quantile(p, df):
    lo, hi = 0.0, 1.0
    while _integrated_cdf(hi, df) < p:
        hi *= 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _integrated_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize("df", [1, 2, 3, 7, 29, 120])
@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995])
def test_the_closed_form_quantile_equals_the_integrated_one(p, df):
    """The live A/B's interval costs microseconds: the closed form (incomplete beta, Newton) equals the numerically
    integrated quantile to 1e-6, and its CDF the integrated CDF."""
    q = t_quantile(p, df)
    assert q == pytest.approx(_integrated_quantile(p, df), abs=1e-6)
    assert t_cdf(q, df) == pytest.approx(p, abs=1e-12) and t_cdf(-q, df) == pytest.approx(1 - p, abs=1e-12)
    assert t_cdf(1.3, df) == pytest.approx(_integrated_cdf(1.3, df), abs=1e-9)


def test_an_interval_costs_well_under_a_millisecond():
    """Counted in calls, not timed: a fresh quantile (cache cleared) evaluates the CDF a few dozen times at most."""
    import lightning_codraft.rl.reports.stats as stats

    calls = []
    real = stats.t_cdf
    t_quantile.cache_clear()
    try:
        stats.t_cdf = lambda x, df: calls.append(1) or real(x, df)
        t_quantile(0.975, 37)
    finally:
        stats.t_cdf = real
    assert 0 < len(calls) <= 40


@pytest.mark.parametrize("df, q975", [(1, 12.7062), (2, 4.3027), (5, 2.5706), (10, 2.2281), (14, 2.1448),
                                      (30, 2.0423), (1000, 1.9623)])
def test_t_quantile_matches_the_table(df, q975):
    assert t_quantile(0.975, df) == pytest.approx(q975, abs=2e-4)
    assert t_quantile(0.025, df) == pytest.approx(-q975, abs=2e-4)
    assert t_cdf(q975, df) == pytest.approx(0.975, abs=1e-5)


def test_paired_difference():
    a = [3.0, 3.5, 2.5, 4.0, 3.0]
    b = [2.0, 2.0, 2.0, 2.5, 2.5]
    d = paired_difference(a, b)
    diffs = [1.0, 1.5, 0.5, 1.5, 0.5]
    sd = math.sqrt(sum((x - 1.0) ** 2 for x in diffs) / 4)
    assert d.mean == pytest.approx(1.0) and d.sd == pytest.approx(sd) and d.n == 5 and d.wins == 5
    half = 2.7764 * sd / math.sqrt(5)  # t_{0.975, 4}
    assert d.low == pytest.approx(1.0 - half, abs=1e-3) and d.high == pytest.approx(1.0 + half, abs=1e-3)
    assert "+1.000" in str(d)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match=">= 2 pairs"):
        paired_difference([1.0], [2.0])
    with pytest.raises(ValueError, match="finite"):
        paired_difference([1.0, float("nan")], [2.0, 1.0])

import math

import pytest

from lightning_codraft.rl.stats import paired_difference, t_cdf, t_quantile


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

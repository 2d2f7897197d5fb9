"""ConfidenceCalibration (rollout/embedded/confidence.py): bins, the caller's prior rate for unseen bins, and counts of the
positions a row reached only (a proposal after a rejected one was never tested, so it is no evidence)."""

import pytest

from lightning_codraft.rollout.embedded.confidence import EDGES, ConfidenceCalibration


def test_bins_cover_zero_to_one_finer_near_one():
    assert ConfidenceCalibration.bin(0.0) == 0 and ConfidenceCalibration.bin(1.0) == len(EDGES)
    assert ConfidenceCalibration.bin(0.97) != ConfidenceCalibration.bin(0.99)
    assert [ConfidenceCalibration.bin(c) for c in (0.04, 0.06, 0.55, 0.85)] == [0, 1, 6, 9]


def test_an_unseen_bin_predicts_the_prior():
    assert ConfidenceCalibration(prior_weight=8).rates(0.4) == [0.4] * (len(EDGES) + 1)


def test_only_reached_positions_count():
    cal = ConfidenceCalibration(prior_weight=1)
    # two rows, three proposals each, two verified: row 0 accepted 0 (reached position 0 only), row 1 accepted 2
    confidences = [[0.55, 0.55], [0.85, 0.85], [0.99, 0.99]]
    cal.observe(confidences, accepted=[0, 2], verified=2)
    mid, high, top = (ConfidenceCalibration.bin(c) for c in (0.55, 0.85, 0.99))
    assert cal.tried[mid] == 2 and cal.acc[mid] == 1          # position 0: both rows tested, row 1 accepted
    assert cal.tried[high] == 1 and cal.acc[high] == 1        # position 1: only row 1 reached it
    assert cal.tried[top] == 0                                # position 2 was drawn but not verified
    cal.decay(0.5)
    assert cal.tried[mid] == 1 and cal.acc[high] == 0.5


def test_evidence_moves_the_rate_away_from_the_prior():
    cal = ConfidenceCalibration(prior_weight=8)
    for _ in range(200):        # an overconfident draft: proposals at 0.95-0.98 accepted a third of the time
        cal.observe([[0.96, 0.96, 0.96]], accepted=[1, 0, 0], verified=1)
    rates = cal.rates(0.9)
    assert rates[ConfidenceCalibration.bin(0.96)] == pytest.approx(1 / 3, abs=0.03)
    assert rates[ConfidenceCalibration.bin(0.5)] == 0.9                                   # no evidence there
    with pytest.raises(ValueError, match="prior_weight"):
        ConfidenceCalibration(prior_weight=0)

"""The acceptance watch warns once when a step's acceptance falls well below its recent median, again only after it
recovered, and never while it varies within the band."""

import math

import pytest

from lightning_codraft.rl.acceptance_watch import AcceptanceWatch


def test_a_fall_warns_once_and_again_after_recovery():
    watch = AcceptanceWatch(window=4, drop=0.25)
    said = [watch.observe(s, a) for s, a in enumerate([3.0, 3.2, 2.9, 3.1, 3.0, 2.0, 2.1, 3.0, 2.0], start=1)]
    warned = [s for s, m in zip(range(1, 10), said) if m is not None]
    assert warned == [6, 9]  # 2.0 < 0.75 x 3.05; 2.1 stays quiet (same fall); 3.0 recovers; 2.0 warns again
    assert "below its recent level 3.05" in said[5]


def test_noise_within_the_band_and_missing_steps_never_warn():
    watch = AcceptanceWatch(window=3, drop=0.25)
    for s, a in enumerate([3.0, 2.5, 3.2, 2.4, math.nan, 2.6, 3.1], start=1):
        assert watch.observe(s, a) is None
    with pytest.raises(ValueError, match="drop"):
        AcceptanceWatch(drop=1.5)

"""A warning when the rollouts' acceptance falls well below its recent healthy level.

A drafter that stops matching the policy (a stale drafter in an asynchronous run, a frozen one as the policy drifts,
a schedule that skips too many updates) shows first as a fall of the engine's acceptance length. :class:`AcceptanceWatch`
keeps the last ``window`` steps' acceptance; its healthy level is their median, and a step whose acceptance is below
``(1 - drop)`` of it gets one warning line naming the step, both figures, the sample staleness and the draft version;
it warns again only after the acceptance has recovered.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Optional


class AcceptanceWatch:
    """Warns when the acceptance length falls well below its recent healthy level.

    Args:
        window: steps whose median is the healthy level (the watch is silent until it has this many).
        drop: the share of the healthy level lost that warns (0.25: below 75% of it).
    """

    def __init__(self, window: int = 8, drop: float = 0.25):
        if window < 2:
            raise ValueError(f"window={window} must be >= 2")
        if not 0.0 < drop < 1.0:
            raise ValueError(f"drop={drop} must be in (0, 1)")
        self.window, self.drop = int(window), float(drop)
        self.recent: deque[float] = deque(maxlen=self.window)
        self.warned = False

    def observe(
        self, step: int, acceptance: float, staleness: float = 0.0, draft_version: float = 0.0
    ) -> Optional[str]:
        """Record a step's acceptance length; the warning line when it is well below the healthy level, else None.
        Steps without drafting (NaN, or 1.0 from a plain engine before any draft) are not recorded."""
        if math.isnan(acceptance):
            return None
        message = None
        if len(self.recent) == self.window:
            healthy = statistics.median(self.recent)
            if acceptance < (1.0 - self.drop) * healthy:
                if not self.warned:
                    message = (
                        f"step {step}: acceptance length {acceptance:.2f} is {1 - acceptance / healthy:.0%} below its "
                        f"recent level {healthy:.2f} (median of the last {self.window} steps; sample staleness "
                        f"{staleness:g}, draft version {draft_version:g}): the drafter no longer matches the policy "
                        f"(docs/cotraining.md)"
                    )
                self.warned = True
                return message  # a fallen step is not the healthy level
            self.warned = False
        self.recent.append(acceptance)
        return message

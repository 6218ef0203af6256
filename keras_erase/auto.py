"""`ScheduleSelector`: the measuring rule of `EraseModel(dispatch="auto")` on CUDA."""

import numpy as np

__all__ = ["AUTO_MARGIN", "EARLY_STOP_ROUNDS", "ScheduleSelector"]

# A schedule replaces the baseline only when this much faster (median and p90).
AUTO_MARGIN = 0.03
# Timed steps after which a challenger not clearly faster than the baseline is dropped.
EARLY_STOP_ROUNDS = 2


class ScheduleSelector:
    """Chooses one of several step schedules by timing them, round robin; the first is the baseline.

    A challenger whose median after `early_stop_rounds` timed steps is not
    `margin` below the baseline's is dropped (`drop_medians`). After
    `timed_rounds` timed steps each, one replaces the baseline only if its
    median and p90 are both `margin` below the baseline's; the smallest p90 wins.

    Args:
        candidates: hashable schedules; the first is the baseline.
        timed_rounds, warmup_rounds: timed and untimed steps per candidate.
        extra_warmup: optional `{candidate: n}` more untimed steps (CUDA Graph capture).
        margin, early_stop_rounds: as above (`None`: no early stop).
        combine: optional `list of floats -> list of floats` applied to the
            statistics before the choice (the mean over ranks); no early stop then.
    """

    def __init__(
        self,
        candidates,
        timed_rounds=8,
        warmup_rounds=1,
        extra_warmup=None,
        margin=AUTO_MARGIN,
        early_stop_rounds=EARLY_STOP_ROUNDS,
        combine=None,
    ):
        if not candidates:
            raise ValueError(
                "ScheduleSelector: `candidates` must hold at least one schedule. "
                f"Received: candidates={candidates!r}"
            )
        self.candidates = list(candidates)
        self.timed_rounds = max(1, int(timed_rounds))
        self.warmup = {
            c: int(warmup_rounds) + int((extra_warmup or {}).get(c, 0)) for c in self.candidates
        }
        self.margin = float(margin)
        self.early_stop_rounds = None if combine is not None else early_stop_rounds
        self.combine = combine
        self.times = {c: [] for c in self.candidates}
        self.seen = {c: 0 for c in self.candidates}
        self.active = list(self.candidates)
        self.dropped = []  # by the early stop
        self.drop_medians = {}  # {dropped: (its median, the baseline's median) when dropped}
        self.choice = self.candidates[0] if len(self.candidates) == 1 else None
        self.combined = None  # the statistics the choice was made on
        self.steps = 0
        self._turn = 0

    @property
    def done(self):
        return self.choice is not None

    def _needs(self, candidate):
        return self.seen[candidate] < self.warmup[candidate] + self.timed_rounds

    def next_schedule(self):
        """The schedule for the next step: a trial, or the choice once made."""
        if self.done:
            return self.choice
        waiting = [c for c in self.active if self._needs(c)]
        return waiting[self._turn % len(waiting)]

    def record(self, schedule, seconds):
        """Counts a step of `schedule` that took `seconds`; may make the choice."""
        if self.done:
            return
        self.steps += 1
        self._turn += 1
        self.seen[schedule] += 1
        if self.seen[schedule] > self.warmup[schedule]:
            self.times[schedule].append(float(seconds))
        self._early_stop()
        if not self.done and not any(self._needs(c) for c in self.active):
            self._decide()

    def _early_stop(self):
        rounds = self.early_stop_rounds
        base = self.candidates[0]
        if rounds is None or len(self.times[base]) < rounds:
            return
        base_median = float(np.median(self.times[base]))
        for c in self.active[1:]:
            if len(self.times[c]) < rounds:
                continue
            median = float(np.median(self.times[c]))
            if median > base_median * (1.0 - self.margin):
                self.active.remove(c)
                self.dropped.append(c)
                self.drop_medians[c] = (median, base_median)
        if len(self.active) == 1:
            self.choice = base

    def statistics(self):
        return {
            c: (float(np.median(t)), float(np.percentile(t, 90)))
            for c, t in self.times.items()
            if t
        }

    def _decide(self):
        stats = self.statistics()
        if self.combine is not None:
            keys = [c for c in self.candidates if c in stats]
            flat = self.combine([v for c in keys for v in stats[c]])
            stats = {c: (flat[2 * i], flat[2 * i + 1]) for i, c in enumerate(keys)}
        self.combined = stats
        base_median, base_p90 = stats[self.candidates[0]]
        limit = 1.0 - self.margin
        faster = [
            c for c in self.active[1:]
            if stats[c][0] <= base_median * limit and stats[c][1] <= base_p90 * limit
        ]
        self.choice = min(faster, key=lambda c: stats[c][1]) if faster else self.candidates[0]

    def timings(self):
        """`{schedule: {"median_s", "p90_s", "steps"}}` for every timed candidate."""
        stats = self.combined or self.statistics()
        return {
            str(c): {"median_s": m, "p90_s": p, "steps": len(self.times[c])}
            for c, (m, p) in stats.items()
        }

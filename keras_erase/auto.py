"""`ScheduleSelector`: the measuring rule of `EraseModel(dispatch="auto")`.

The selector knows nothing about models: it hands out the schedule for the
next training step, receives the step's duration, and after enough steps
keeps one schedule for the rest of training.

Rule:

- Steps go round robin over the candidates still measured (a slow drift of the
  machine's load hits every candidate alike). The first candidate is the
  baseline (the standard step).
- The first `warmup_rounds` steps of each candidate, plus `extra_warmup[c]`
  more for candidate `c` (e.g. the CUDA Graph capture steps of a graphed
  schedule), are not timed.
- First-step drop (single process only, with `first_step_drop`, for
  candidates whose first step costs what their later ones do, e.g. on CPU):
  the baseline runs its warm-up step and two timed steps before any
  challenger (these are ordinary training steps: they cost nothing), and a
  challenger whose first (untimed) step already takes more than
  `first_step_drop` times the baseline's fastest timed step is dropped at once. A losing
  schedule then costs one of its steps, not three: in a short `fit` on a
  machine where the standard step is already the fastest, the measuring is
  what `auto` costs. A reference dropped this way no longer binds its
  challenger: it was clearly slower than the baseline, which runs on the
  challenger's whole thread budget, so there is no gain from fewer threads
  per side to guard against.
- Early stop (single process only): once the baseline and a challenger both
  have `early_stop_rounds` timed steps, a challenger whose median is not
  already `margin` below the baseline's is dropped (it is not winning
  clearly); when every challenger is dropped the baseline is kept at once.
  This bounds what measuring a losing schedule costs: a challenger `s` times
  slower than the baseline runs `warmup_rounds + early_stop_rounds` (1 + 2)
  steps, so an epoch loses `3 * (s - 1)` baseline steps (1.5% of a 100-step
  epoch at `s = 1.5`). Only a challenger clearly faster in its first timed
  steps is measured fully, and those steps are faster ones.
- A challenger may also name a `reference` (e.g. `"threaded"` at 1+1 threads
  has the standard step at 1 thread, the threads each side of it gets): it
  must then beat its reference as it must beat the baseline, in the early stop
  and in the final choice, so a schedule is never kept for a gain that only
  comes from running on a different thread budget.
- After `timed_rounds` timed steps of every remaining candidate: a challenger
  replaces the baseline only if both its median and its 90th-percentile step
  time are at least `margin` below the baseline's (and its reference's);
  among those the smallest 90th percentile wins.

With `combine` (e.g. the mean over torch.distributed ranks) the statistics are
combined before deciding, so every rank keeps the same schedule; early stop is
then off (ranks must run the same schedule at every step).

Example:

>>> from keras_erase.auto import ScheduleSelector
>>> selector = ScheduleSelector([("standard", 2), ("threaded", 1)], timed_rounds=3)
>>> while not selector.done:
...     schedule = selector.next_schedule()
...     selector.record(schedule, 1.0 if schedule[0] == "standard" else 0.5)
>>> selector.choice, selector.steps
(('threaded', 1), 8)
"""

import numpy as np

__all__ = ["AUTO_MARGIN", "EARLY_STOP_ROUNDS", "FIRST_STEP_DROP", "ScheduleSelector", "label"]

# A schedule replaces the baseline only when this much faster (median and p90).
AUTO_MARGIN = 0.03
# Timed steps after which a challenger not clearly faster than the baseline is dropped.
EARLY_STOP_ROUNDS = 2
# A challenger whose first step takes this many baseline steps is dropped at once.
FIRST_STEP_DROP = 1.15
# Timed baseline steps before the first challenger, with the first-step drop.
FIRST_STEP_BASELINE = 2


def label(schedule):
    """Formats a schedule as its `EraseModel.auto_timings` key: `("threaded", 1)` -> `"threaded@1"`."""
    if isinstance(schedule, tuple):
        return "@".join(str(part) for part in schedule)
    return str(schedule)


class ScheduleSelector:
    """Chooses one of several training-step schedules by timing them (see the module docstring).

    Args:
        candidates: hashable schedules; the first is the baseline.
        timed_rounds: timed steps per candidate before the final choice.
        warmup_rounds: untimed steps per candidate before its timed ones.
        extra_warmup: optional `{candidate: n}`, `n` more untimed steps for
            that candidate (e.g. CUDA Graph capture).
        margin: relative gain on median and p90 needed to leave the baseline.
        early_stop_rounds: timed steps after which a challenger whose median
            is not `margin` below the baseline's is dropped; `None` disables
            early stop.
        combine: optional function from a list of floats to a list of floats
            (same length) applied to the statistics before the final choice.
        references: optional `{challenger: candidate}`: the challenger must
            also be `margin` faster than that candidate to be kept.
        first_step_drop: optional ratio: a challenger whose first step takes
            more than this many times the baseline's fastest timed step is
            dropped at once (`None`, the default, disables it; off with
            `combine`).
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
        references=None,
        first_step_drop=None,
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
        self.warmup_rounds = int(warmup_rounds)
        self.margin = float(margin)
        self.early_stop_rounds = None if combine is not None else early_stop_rounds
        self.combine = combine
        self.references = dict(references or {})
        self.first_step_drop = None if combine is not None else first_step_drop
        for challenger, reference in self.references.items():
            if challenger not in self.candidates or reference not in self.candidates:
                raise ValueError(
                    "ScheduleSelector: every `references` key and value must be a candidate. "
                    f"Received: references={references!r}"
                )
        self.times = {c: [] for c in self.candidates}
        self.seen = {c: 0 for c in self.candidates}
        self.active = list(self.candidates)
        self.dropped = []  # by the early stop or the first-step drop
        self.dropped_at_first_step = []
        self.choice = self.candidates[0] if len(self.candidates) == 1 else None
        self.combined = None  # the statistics the choice was made on
        self.steps = 0
        self._turn = 0

    @property
    def done(self):
        """Whether the choice is made."""
        return self.choice is not None

    def _needs(self, candidate):
        return self.seen[candidate] < self.warmup[candidate] + self.timed_rounds

    def next_schedule(self):
        """Returns the schedule for the next step: a trial, or the choice once made."""
        if self.done:
            return self.choice
        if self._in_preamble():
            return self.candidates[0]  # the baseline's warm-up and first timed steps come first
        waiting = [c for c in self.active if self._needs(c)]
        return waiting[self._turn % len(waiting)]

    def record(self, schedule, seconds):
        """Counts a step of `schedule` that took `seconds`; may make the choice."""
        if self.done:
            return
        self.steps += 1
        self._turn = 1 if self._in_preamble() else self._turn + 1  # then the first challenger
        self.seen[schedule] += 1
        if self.seen[schedule] > self.warmup[schedule]:
            self.times[schedule].append(float(seconds))
        elif self.seen[schedule] == 1:
            self._first_step_drop(schedule, float(seconds))
        self._early_stop()
        if not self.done and not any(self._needs(c) for c in self.active):
            self._decide()

    def _in_preamble(self):
        base = self.candidates[0]
        return (self.first_step_drop is not None
                and len(self.times[base]) < min(FIRST_STEP_BASELINE, self.timed_rounds))

    def _first_step_drop(self, schedule, seconds):
        base = self.candidates[0]
        if (self.first_step_drop is None or schedule == base or not self.times[base]
                or self.warmup[schedule] != self.warmup_rounds):  # e.g. graph capture first
            return
        if seconds > min(self.times[base]) * self.first_step_drop:
            self._drop(schedule)
            self.dropped_at_first_step.append(schedule)

    def _drop(self, schedule):
        self.active.remove(schedule)
        self.dropped.append(schedule)
        if len(self.active) == 1:
            self.choice = self.candidates[0]

    def _early_stop(self):
        rounds = self.early_stop_rounds
        base = self.candidates[0]
        if rounds is None or len(self.times[base]) < rounds:
            return
        keep = 1.0 - self.margin
        limit = np.median(self.times[base]) * keep
        for c in self.active[1:]:
            if len(self.times[c]) < rounds:
                continue
            median = np.median(self.times[c])
            ref = self.references.get(c)
            beaten = ref is not None and len(self.times[ref]) >= rounds and (
                median > np.median(self.times[ref]) * keep
            )
            if median > limit or beaten:
                self._drop(c)

    def statistics(self):
        """Returns `{candidate: (median_s, p90_s)}` over the timed steps (candidates with any)."""
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
        base = self.candidates[0]
        base_median, base_p90 = stats[base]
        limit = 1.0 - self.margin

        def beats(c, other):
            return other not in stats or (
                stats[c][0] <= stats[other][0] * limit and stats[c][1] <= stats[other][1] * limit
            )

        faster = [
            c for c in self.active[1:]
            if stats[c][0] <= base_median * limit and stats[c][1] <= base_p90 * limit
            and (c not in self.references or beats(c, self.references[c]))
        ]
        self.choice = min(faster, key=lambda c: stats[c][1]) if faster else base

    def timings(self):
        """Returns `{"mode@threads": {"median_s", "p90_s", "steps"}}` for every timed candidate."""
        stats = self.combined or self.statistics()
        return {
            label(c): {"median_s": m, "p90_s": p, "steps": len(self.times[c])}
            for c, (m, p) in stats.items()
        }

"""`dispatch="auto"` on torch: its candidates, `ScheduleSelector` (the measuring rule on CUDA) and how a
schedule explains itself. The one module that chooses `"auto"`'s schedule."""

import dataclasses

import numpy as np

from keras_erase.config import STANDARD
from keras_erase.config import Schedule
from keras_erase.config import schedule_of
from keras_erase.torch.cuda_graphs.runner import DEFAULT_WARMUP
from keras_erase.torch.cuda_graphs.runner import untimed_steps

__all__ = [
    "AUTO_LAUNCHERS", "AUTO_MARGIN", "AUTO_STEP_LIMIT", "CPU_EXPLANATION", "EARLY_STOP_ROUNDS", "ScheduleSelector", "auto_candidates",
    "describe_schedule", "explain", "explain_fixed", "new_selector", "timed_rounds",
]

# A schedule replaces the baseline only when this much faster (median and p90).
AUTO_MARGIN = 0.03
# Timed steps after which a challenger not clearly faster than the baseline is dropped.
EARLY_STOP_ROUNDS = 2
# "auto" on CUDA settles within this many steps, graph warm-ups and captures included.
AUTO_STEP_LIMIT = 30
# The launchers "auto" measures (`auto_candidates`).
AUTO_LAUNCHERS = ("worker",)


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
        one_at_a_time: candidates measured one after another, never
            interleaved (graphed ones: one holds graph pools at a time).
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
        one_at_a_time=(),
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
        self.one_at_a_time = [c for c in self.candidates if c in set(one_at_a_time)]
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

    def measured(self, candidate):
        """Whether `candidate` needs no more steps to be measured (timed through, or dropped)."""
        return candidate not in self.active or not self._needs(candidate)

    def next_schedule(self):
        """The schedule for the next step: a trial, or the choice once made."""
        if self.done:
            return self.choice
        waiting = [c for c in self.active if self._needs(c)]
        serial = [c for c in waiting if c in self.one_at_a_time]
        if serial:  # the one begun first, else the first in line
            current = next((c for c in serial if self.seen[c] > 0), serial[0])
            waiting = [c for c in waiting if c not in serial or c == current]
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


CPU_EXPLANATION = (
    "dispatch='auto' on CPU: the standard step; ERASE's early backward needs a GPU to overlap. "
    "Every step, from the first, runs the standard step and nothing is measured (a schedule "
    "named in `dispatch`, e.g. 'blocking' or 'threaded', runs on CPU as well)"
)


def auto_candidates(graphs=False):
    """The names `"auto"` measures: the standard step, then the worker's schedules (+ graphed).

    The inline launcher is left out: on the H200 it never came within 6% of
    the worker's schedules at any batch (docs/benchmarks.md), and two fewer
    candidates let `"auto"` settle within `AUTO_STEP_LIMIT` steps.
    """
    schedules = [s for s in Schedule.every(graphs=False) if s.launcher in AUTO_LAUNCHERS]
    if graphs:
        schedules += [dataclasses.replace(s, graphs=True) for s in schedules]
    return [STANDARD] + [s.name for s in schedules]


def timed_rounds(candidates, untimed, most):
    """Timed steps per candidate: at most `most`, fewer where the untimed and timed steps of every
    candidate would pass `AUTO_STEP_LIMIT` (`untimed`: `{candidate: untimed steps}`)."""
    left = AUTO_STEP_LIMIT - sum(untimed.values())
    return max(1, min(int(most), left // len(candidates)))


def new_selector(config, combine=None):
    """The `ScheduleSelector` of `"auto"` on CUDA; `combine`: the mean over ranks, or `None`."""
    candidates = auto_candidates(config.cuda_graphs)
    # graph warm-up and capture steps are never timed
    extra_warmup = {c: untimed_steps(DEFAULT_WARMUP) - 1 for c in candidates if _graphed(c)}
    untimed = {c: 1 + extra_warmup.get(c, 0) for c in candidates}
    return ScheduleSelector(
        candidates,
        timed_rounds=timed_rounds(candidates, untimed, config.auto_steps),
        warmup_rounds=1,
        extra_warmup=extra_warmup,
        combine=combine,
        one_at_a_time=[c for c in candidates if _graphed(c)],  # one set of graph pools at a time
    )


def _graphed(label):
    schedule = schedule_of(label)
    return schedule is not None and schedule.graphs


def describe_schedule(label):
    """Says what a label runs: `"standard (Keras's train step)"`, or its launcher, placement and graphs."""
    s = schedule_of(label)
    if s is None:
        return "standard (Keras's train step)"
    return (f"{label} (launcher {s.launcher!r}, placement {s.placement!r}, CUDA Graphs "
            f"{'per block' if s.graphs else 'off'})")


def explain_fixed(runtime, cuda):
    """Says what a fixed (not `"auto"`) `dispatch` runs every step."""
    config = runtime.config
    schedule = config.schedule(cuda)
    if config.dispatch != "early":
        return f"dispatch={config.dispatch!r}: that schedule runs every step"
    return (f"dispatch={config.dispatch!r}: launcher {schedule.launcher!r}, placement "
            f"{schedule.placement!r}, CUDA Graphs {'per block' if schedule.graphs else 'off'}, "
            "every step")


def explain(runtime, finished_fit=False):
    """What `"auto"` compared and kept (or, still measuring, what ran so far), with the figures the rule used."""
    selector = runtime.selector
    if selector is None:
        return None
    stats = selector.combined or selector.statistics()
    base = selector.candidates[0]
    parts = []
    for c in selector.candidates:
        if c in selector.drop_medians:
            median, base_median = selector.drop_medians[c]
            timed = (f"dropped after {_count(len(selector.times[c]), 'timed step')}: median "
                     f"{median * 1e3:.1f} ms, not {selector.margin:.0%} below {base}'s "
                     f"{base_median * 1e3:.1f} ms then")
        elif c in stats:
            median, p90 = stats[c]
            timed = (f"median {median * 1e3:.1f} ms, p90 {p90 * 1e3:.1f} ms over "
                     f"{_count(len(selector.times[c]), 'timed step')}")
        else:
            timed = "no timed step yet"
        parts.append(f"{describe_schedule(c)}: {_count(selector.seen[c], 'step')}, {timed}")
    rule = (f"a challenger is kept only if its median and p90 step time are both at least "
            f"{selector.margin:.0%} below the baseline {base}'s; one whose median is not "
            f"{selector.margin:.0%} below the baseline's after its first timed steps is dropped")
    if selector.done:
        head = (f"dispatch='auto' on CUDA kept {describe_schedule(selector.choice)} after "
                f"{selector.steps} measuring steps")
    else:
        head = (f"dispatch='auto' on CUDA is still measuring after {selector.steps} steps"
                + (" when fit ended" if finished_fit else "")
                + ": no schedule is kept yet (dispatch_choice is None); the steps so far ran "
                "the candidates in turn, and the next training step goes on measuring")
    return f"{head}. Compared: " + "; ".join(parts) + f". Rule: {rule}."


def _count(count, noun):
    return f"{count} {noun}{'' if count == 1 else 's'}"

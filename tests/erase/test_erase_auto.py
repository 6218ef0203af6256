"""`ScheduleSelector` (the rule of `dispatch="auto"`), without a model: every backend."""

import pytest

from keras_erase.torch.auto import ScheduleSelector

BASE = [1.0] * 7 + [1.2] * 3  # the standard step: median 1.0, p90 1.2


def run(selector, times, warmup_seconds=100.0):
    """Feeds the selector until it chooses: the i-th timed step of `c` takes `times[c][i]`."""
    used = {c: 0 for c in times}
    while not selector.done:
        schedule = selector.next_schedule()
        count = used[schedule]
        used[schedule] += 1
        untimed = selector.warmup[schedule]
        seconds = warmup_seconds if count < untimed else times[schedule][count - untimed]
        selector.record(schedule, seconds)
    return selector.choice


@pytest.mark.parametrize(
    "streams,threaded,expected",
    [
        # (median, p90 shape) per candidate; standard is always BASE.
        ([0.8] * 7 + [1.3] * 3, [1.0] * 10, "standard"),  # faster median, worse tail
        ([0.9] * 7 + [1.1] * 3, [0.7] * 7 + [1.0] * 3, "threaded"),  # both faster: best p90
        ([0.98] * 7 + [1.0] * 3, [1.1] * 10, "standard"),  # median within the margin
        ([0.5] * 7 + [0.6] * 3, [0.7] * 7 + [1.0] * 3, "streams"),
    ],
)
def test_rule_needs_a_clear_gain_on_median_and_p90(streams, threaded, expected):
    candidates = ["standard", "streams", "threaded"]
    selector = ScheduleSelector(candidates, timed_rounds=10, early_stop_rounds=None)
    times = dict(zip(candidates, [BASE, streams, threaded]))
    assert run(selector, times) == expected
    assert set(selector.timings()) == set(candidates)
    assert all(len(selector.times[c]) == 10 for c in candidates)  # warm-up steps not timed


def test_round_robin_and_extra_untimed_warmup_per_candidate():
    """A candidate's extra warm-up steps (e.g. CUDA Graph capture) are run but never timed."""
    candidates = ["standard", "graphs"]
    selector = ScheduleSelector(candidates, timed_rounds=3, extra_warmup={"graphs": 2},
                                early_stop_rounds=None)
    order = []
    while not selector.done:
        schedule = selector.next_schedule()
        order.append(schedule)
        # The capture steps are very slow; every timed graphs step is fast.
        seconds = {"standard": 1.0, "graphs": 50.0 if order.count("graphs") <= 3 else 0.5}
        selector.record(schedule, seconds[schedule])
    assert order[:4] == ["standard", "graphs", "standard", "graphs"]
    assert order.count("standard") == 4 and order.count("graphs") == 6
    assert selector.times["graphs"] == [0.5] * 3  # the 3 untimed steps are not in the timings
    assert selector.choice == "graphs"


@pytest.mark.parametrize("slowdown", [1.3, 0.99])
def test_a_candidate_not_clearly_faster_is_dropped_after_two_timed_rounds(slowdown):
    """Early stop: measuring a schedule that is not winning clearly (slower, or faster by
    less than the margin) costs 1 warm-up + 2 timed steps, not 1 + 8; the medians it was
    dropped on are kept for the explanation."""
    selector = ScheduleSelector(["standard", "threaded"], timed_rounds=8)
    choice = run(selector, {"standard": [1.0, 1.04] + [5.0] * 6, "threaded": [slowdown] * 8})
    assert choice == "standard"
    assert selector.dropped == ["threaded"]
    assert len(selector.times["threaded"]) == 2
    assert selector.steps == 2 * (1 + 2)
    assert selector.seen["threaded"] == 3  # the cost bound of the docstring
    assert selector.drop_medians == {"threaded": pytest.approx((slowdown, 1.02))}


def test_a_faster_candidate_is_measured_fully_and_wins():
    selector = ScheduleSelector(["standard", "threaded"], timed_rounds=8)
    assert run(selector, {"standard": [1.0] * 8, "threaded": [0.8] * 8}) == "threaded"
    assert selector.steps == 2 * (1 + 8) and not selector.dropped


def test_no_early_stop_when_ranks_combine_their_timings():
    """Ranks must run the same schedule at every step: no local early stop, combined stats."""
    seen = []

    def combine(values):
        seen.append(list(values))
        return [v * 1.0 for v in values]

    selector = ScheduleSelector(["standard", "threaded"], timed_rounds=8, combine=combine)
    assert run(selector, {"standard": [1.0] * 8, "threaded": [1.3] * 8}) == "standard"
    assert selector.steps == 18 and len(seen) == 1 and len(seen[0]) == 4

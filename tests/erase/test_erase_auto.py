"""`ScheduleSelector` (the rule of `dispatch="auto"`), without a model: every backend."""

import pytest

from keras_erase.auto import ScheduleSelector

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
    "threaded_2,threaded_1,expected",
    [
        # (median, p90 shape) per candidate; standard is always BASE.
        ([0.8] * 7 + [1.3] * 3, [1.0] * 10, ("standard", 2)),  # faster median, worse tail
        ([0.9] * 7 + [1.1] * 3, [0.7] * 7 + [1.0] * 3, ("threaded", 1)),  # both faster: best p90
        ([0.98] * 7 + [1.0] * 3, [1.1] * 10, ("standard", 2)),  # median within the margin
        ([0.5] * 7 + [0.6] * 3, [0.7] * 7 + [1.0] * 3, ("threaded", 2)),
    ],
)
def test_rule_needs_a_clear_gain_on_median_and_p90(threaded_2, threaded_1, expected):
    candidates = [("standard", 2), ("threaded", 2), ("threaded", 1)]
    selector = ScheduleSelector(candidates, timed_rounds=10, early_stop_rounds=None)
    times = dict(zip(candidates, [BASE, threaded_2, threaded_1]))
    assert run(selector, times) == expected
    assert set(selector.timings()) == {"standard@2", "threaded@2", "threaded@1"}
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
    less than the margin) costs 1 warm-up + 2 timed steps, not 1 + 8."""
    selector = ScheduleSelector(["standard", "threaded"], timed_rounds=8)
    choice = run(selector, {"standard": [1.0] * 8, "threaded": [slowdown] * 8})
    assert choice == "standard"
    assert selector.dropped == ["threaded"]
    assert len(selector.times["threaded"]) == 2
    assert selector.steps == 2 * (1 + 2)
    assert selector.seen["threaded"] == 3  # the cost bound of the docstring


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


# Equal thread budgets: on an oversubscribed 2-core machine the standard step at 2
# threads is slow (the OpenMP teams fight), the standard step at 1 thread is fast, and
# "threaded" at 1 + 1 threads only looks fast against the 2-thread one.
OVERSUBSCRIBED = {
    ("standard", 2): [10.0] * 10,
    ("standard", 1): [1.0] * 10,
    ("threaded", 1): [1.1] * 10,
}
CANDIDATES = [("standard", 2), ("standard", 1), ("threaded", 1)]
REFERENCES = {("threaded", 1): ("standard", 1)}


@pytest.mark.parametrize("early_stop_rounds", [None, 2])
def test_threaded_must_beat_the_standard_step_at_its_own_threads(early_stop_rounds):
    selector = ScheduleSelector(CANDIDATES, timed_rounds=6, references=REFERENCES,
                                early_stop_rounds=early_stop_rounds)
    assert run(selector, OVERSUBSCRIBED) == ("standard", 1)
    if early_stop_rounds is not None:  # dropped as soon as its reference beats it
        assert ("threaded", 1) in selector.dropped
        assert len(selector.times[("threaded", 1)]) == 2
    # without the reference the same timings would keep threaded (10x "faster")
    plain = ScheduleSelector(CANDIDATES[::2], timed_rounds=6, early_stop_rounds=None)
    assert run(plain, OVERSUBSCRIBED) == ("threaded", 1)


def test_threaded_is_kept_when_it_beats_both_standard_steps():
    times = {**OVERSUBSCRIBED, ("threaded", 1): [0.5] * 10}
    selector = ScheduleSelector(CANDIDATES, timed_rounds=6, references=REFERENCES)
    assert run(selector, times) == ("threaded", 1)


def test_references_must_be_candidates():
    with pytest.raises(ValueError, match=r"`references` .*Received: references="):
        ScheduleSelector(CANDIDATES, references={("threaded", 1): ("standard", 4)})


def test_first_step_drop_costs_a_losing_schedule_one_step():
    """On CPU a candidate's first step costs what its later ones do: one clearly slower
    step drops it, after the baseline's warm-up and two timed steps."""
    candidates = [("standard", 2), ("standard", 1), ("threaded", 1)]
    selector = ScheduleSelector(candidates, timed_rounds=8, references=REFERENCES,
                                first_step_drop=1.25)
    order = []
    times = {("standard", 2): 1.0, ("standard", 1): 1.6, ("threaded", 1): 1.3}
    while not selector.done:
        schedule = selector.next_schedule()
        order.append(schedule)
        selector.record(schedule, times[schedule])
    assert order[:4] == [("standard", 2)] * 3 + [("standard", 1)]
    assert selector.seen == {("standard", 2): 4, ("standard", 1): 1, ("threaded", 1): 1}
    assert selector.choice == ("standard", 2)
    assert selector.dropped_at_first_step == [("standard", 1), ("threaded", 1)]


def test_first_step_drop_keeps_a_close_challenger_and_its_dropped_reference_stops_binding():
    """A challenger within the ratio is measured as before; a reference dropped as clearly
    slower than the baseline (which has the challenger's whole thread budget) no longer binds it."""
    candidates = [("standard", 2), ("standard", 1), ("threaded", 1)]
    selector = ScheduleSelector(candidates, timed_rounds=4, references=REFERENCES,
                                first_step_drop=1.25)
    times = {("standard", 2): 1.0, ("standard", 1): 1.6, ("threaded", 1): 0.8}
    while not selector.done:
        schedule = selector.next_schedule()
        selector.record(schedule, times[schedule])
    assert selector.choice == ("threaded", 1)
    assert selector.dropped_at_first_step == [("standard", 1)]
    assert len(selector.times[("threaded", 1)]) == 4


@pytest.mark.parametrize("case", ["graph_warmup", "combined_ranks"])
def test_first_step_drop_is_off_for_extra_warmups_and_combined_ranks(case):
    kwargs = dict(extra_warmup={"graphs": 2}) if case == "graph_warmup" else dict(combine=list)
    selector = ScheduleSelector(["standard", "graphs"], timed_rounds=2, first_step_drop=1.25,
                                **kwargs)
    run(selector, {"standard": [1.0] * 4, "graphs": [0.5] * 4}, warmup_seconds=50.0)
    assert selector.dropped_at_first_step == [] and selector.choice == "graphs"


def test_first_step_drop_compares_with_the_fastest_baseline_step():
    """A slow outlier among the baseline's first timed steps does not shield a slow challenger."""
    selector = ScheduleSelector(["standard", "threaded"], timed_rounds=8, first_step_drop=1.15)
    for seconds in (9.0, 3.0, 1.0):  # warm-up, then an outlier and a normal timed step
        assert selector.next_schedule() == "standard"
        selector.record("standard", seconds)
    assert selector.next_schedule() == "threaded"
    selector.record("threaded", 1.3)
    assert selector.dropped_at_first_step == ["threaded"] and selector.choice == "standard"

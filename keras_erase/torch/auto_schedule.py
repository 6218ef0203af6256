"""`dispatch="auto"` on torch (on CUDA its candidates and selector), and how a schedule explains itself."""

from keras_erase.auto import ScheduleSelector
from keras_erase.config import STANDARD
from keras_erase.config import Schedule
from keras_erase.config import schedule_of
from keras_erase.torch.cuda_graphs.runner import DEFAULT_WARMUP
from keras_erase.torch.cuda_graphs.runner import untimed_steps

__all__ = [
    "CPU_EXPLANATION", "auto_candidates", "describe_schedule", "explain", "explain_fixed",
    "new_selector",
]

CPU_EXPLANATION = (
    "dispatch='auto' on CPU: the standard step; ERASE's early backward needs a GPU to overlap. "
    "Every step, from the first, runs the standard step and nothing is measured (a schedule "
    "named in `dispatch`, e.g. 'blocking' or 'threaded', runs on CPU as well)"
)


def auto_candidates(graphs=False):
    """The labels `"auto"` measures: the standard step, then every launcher x placement (+ graphed)."""
    schedules = Schedule.every(graphs=False) + (Schedule.every(graphs=True) if graphs else [])
    return [STANDARD] + [s.label for s in schedules]


def new_selector(config, combine=None):
    """The `ScheduleSelector` of `"auto"` on CUDA; `combine`: the mean over ranks, or `None`."""
    candidates = auto_candidates(config.cuda_graphs)
    # graph warm-up and capture steps are never timed
    extra_warmup = {c: untimed_steps(DEFAULT_WARMUP) - 1 for c in candidates if _graphed(c)}
    return ScheduleSelector(
        candidates,
        timed_rounds=config.auto_steps,
        warmup_rounds=1,
        extra_warmup=extra_warmup,
        combine=combine,
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

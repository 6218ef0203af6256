"""What `dispatch="auto"` compares on torch, and how a schedule explains itself.

`auto_candidates` lists the candidates (on CPU at equal thread budgets, on
CUDA every launcher x placement combination), `new_selector` builds the
`keras_erase.auto.ScheduleSelector` that times them, and `explain` /
`explain_fixed` write `EraseModel.dispatch_explanation`. Nothing here runs a
step: the train step (`keras_erase.torch.train_step`) asks for the schedule
and reports each step's time.

Example:

>>> from keras_erase.torch.auto_schedule import auto_candidates, describe_schedule
>>> candidates, references = auto_candidates(threads=1)
>>> [describe_schedule(c) for c in candidates]
['standard (1 intra-op thread)', 'threaded (main thread 1 + backward worker 1 intra-op threads, 2 in all)']
"""

import dataclasses

from keras_erase.auto import FIRST_STEP_DROP
from keras_erase.auto import ScheduleSelector
from keras_erase.auto import label
from keras_erase.config import PRESETS
from keras_erase.config import Schedule
from keras_erase.torch.cuda_graphs.runner import DEFAULT_WARMUP
from keras_erase.torch.cuda_graphs.runner import untimed_steps
from keras_erase.torch.threads import threads_for_worker

__all__ = [
    "auto_candidates", "describe_schedule", "explain", "explain_fixed", "fixed_label",
    "new_selector",
]


def auto_candidates(threads, graphs=False, cuda=False):
    """Lists the `"auto"` candidates and their references: `([(label, threads)], {c: ref})`.

    The first candidate is the baseline (the standard step). `cuda`: whether
    torch sees a CUDA device.

    On CUDA: every launcher x placement combination (`Schedule.every`), eager,
    and with `graphs` (`cuda_graphs=True`) graphed too: each can win
    somewhere (the worker and a stream per block overlap the device, graphs
    shorten the host path, the inline launch saves the thread hand-off when the
    GPU is saturated). Threads are left alone (`None`).

    On CPU `"threaded"` at `h` threads runs the main thread and the backward
    worker at `h` intra-op threads each: it is compared with the standard
    step at `T` threads (the same budget, `2h <= T`) and, as its reference,
    with the standard step at `h` threads (the threads each side gets), so
    that a gain which only comes from fewer OpenMP threads per thread (an
    oversubscribed machine) keeps the standard step at `h` threads, not the
    threaded schedule. Streams need CUDA; with `graphs` (the CPU stand-in
    capture) the threaded candidate is graphed.
    """
    if cuda:
        schedules = Schedule.every(graphs=False) + (Schedule.every(graphs=True) if graphs else [])
        return [("standard", None)] + [(s.label, None) for s in schedules], {}
    # "threaded" only at most half the cores: a worker thread whose OpenMP team is
    # as wide as the machine slows every later step of the process that runs on fewer
    # threads, so even trying it would cost the standard step.
    half = min(threads, threads_for_worker())
    worker = Schedule("worker", "default_stream", graphs=graphs).label
    if half == threads:  # one thread: both sides already run on the baseline's budget
        return [("standard", threads), (worker, half)], {}
    threaded, narrow = (worker, half), ("standard", half)
    return [("standard", threads), narrow, threaded], {threaded: narrow}


def new_selector(config, threads, cuda, combine=None):
    """Returns the `ScheduleSelector` of an `"auto"` run (`config`: its `EraseConfig`).

    Args:
        config: the model's `keras_erase.config.EraseConfig`.
        threads: torch's current intra-op thread count.
        cuda: whether torch sees a CUDA device.
        combine: statistics combiner over torch.distributed ranks (every rank
            must choose the same schedule; it turns early stops off), or `None`.
    """
    candidates, references = auto_candidates(threads, config.cuda_graphs, cuda)
    # graph warm-up and capture steps are never timed
    extra_warmup = {c: untimed_steps(DEFAULT_WARMUP) - 1 for c in candidates if graphed(c[0])}
    return ScheduleSelector(
        candidates,
        timed_rounds=config.auto_steps,
        warmup_rounds=1,
        extra_warmup=extra_warmup,
        combine=combine,
        references=references,
        # a CPU candidate's first step costs what its later ones do
        first_step_drop=None if cuda else FIRST_STEP_DROP,
    )


def graphed(mode):
    """Returns whether schedule label `mode` is captured as CUDA Graphs."""
    return mode != "standard" and Schedule.from_label(mode).graphs


def describe_schedule(schedule):
    """Says what a candidate runs, e.g. `("standard", 2)` -> `"standard (2 intra-op threads)"`.

    A schedule that is not a plain preset also names its launcher, placement
    and graphs, e.g. `"streams+graphs (launcher 'worker', placement
    'block_streams', CUDA Graphs per block; torch's current intra-op threads)"`.
    """
    mode, threads = schedule
    if threads is None:
        budget = "torch's current intra-op threads"
    elif mode != "standard" and Schedule.from_label(mode).launcher == "worker":
        budget = (f"main thread {threads} + backward worker {threads} intra-op threads, "
                  f"{2 * threads} in all")
    else:
        budget = _count(threads, "intra-op thread")
    if mode == "standard" or (mode in PRESETS and threads is not None):
        return f"{mode} ({budget})"
    s = Schedule.from_label(mode)
    return (f"{mode} (launcher {s.launcher!r}, placement {s.placement!r}, CUDA Graphs "
            f"{'per block' if s.graphs else 'off'}; {budget})")


def fixed_label(config, cuda):
    """The dispatcher key of a fixed `dispatch`: the preset's name, or the `"early"` schedule's label."""
    if config.dispatch == "early":
        return dataclasses.replace(config.schedule(cuda), graphs=False).label
    return config.dispatch


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
    """Writes what `"auto"` compared and kept (or, still measuring, what ran so far)."""
    selector = runtime.selector
    if selector is None:
        return None
    stats = selector.combined or selector.statistics()
    parts = []
    for c in selector.candidates:
        seen = selector.seen[c]
        if c in stats:
            median, p90 = stats[c]
            timed = (f"median {median * 1e3:.1f} ms, p90 {p90 * 1e3:.1f} ms over "
                     f"{_count(len(selector.times[c]), 'timed step')}")
        else:
            timed = "no timed step yet"
        dropped = ""
        if c in selector.dropped_at_first_step:
            dropped = (f" (dropped after its first step: more than {selector.first_step_drop:g}x "
                       "the baseline's fastest timed step)")
        elif c in selector.dropped:
            dropped = " (dropped early: not clearly faster)"
        parts.append(f"{label(c)} = {describe_schedule(c)}: {_count(seen, 'step')}, {timed}{dropped}")
    refs = "; ".join(
        f"{label(c)} must also beat {label(r)} (the same threads per side)"
        for c, r in selector.references.items()
    )
    rule = (f"a challenger is kept only if its median and p90 step time are both at least "
            f"{selector.margin:.0%} below the baseline {label(selector.candidates[0])}'s"
            + (f"; {refs}" if refs else ""))
    if selector.done:
        head = (f"dispatch='auto' kept {label(selector.choice)} = "
                f"{describe_schedule(selector.choice)} after {selector.steps} measuring steps")
    else:
        head = (f"dispatch='auto' is still measuring after {selector.steps} steps"
                + (" when fit ended" if finished_fit else "")
                + f": no schedule is kept yet (dispatch_choice is None); the steps so far ran "
                "the candidates in turn, and the next training step goes on measuring")
    return f"{head}. Compared: " + "; ".join(parts) + f". Rule: {rule}."


def _count(count, noun):
    """`_count(1, "step")` -> `"1 step"`, `_count(3, "step")` -> `"3 steps"`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"

"""Throughput as the ERASE paper reports it: percentiles of per-step examples/s."""

import numpy as np

__all__ = ["examples_per_second", "global_step_seconds", "throughput_percentiles"]


def examples_per_second(step_seconds, batch_size):
    """Per-step examples/s: `batch_size / t` for each step time `t` (seconds).

    Args:
        step_seconds: sequence of positive step durations in seconds.
        batch_size: examples per step (the global batch for global steps).

    Returns:
        A float64 numpy array, one entry per step.

    Raises:
        ValueError: no step time, or one that is not finite and > 0.

    Example:

    >>> examples_per_second([0.5, 0.25], batch_size=10).tolist()
    [20.0, 40.0]
    """
    seconds = np.asarray(step_seconds, dtype=np.float64).reshape(-1)
    if seconds.size == 0:
        raise ValueError(
            "`step_seconds` must hold at least one step time. Received: step_seconds=[]"
        )
    if np.any(~np.isfinite(seconds)) or np.any(seconds <= 0):
        raise ValueError(
            "`step_seconds` must be finite and > 0. "
            f"Received: step_seconds={seconds.tolist()}"
        )
    return float(batch_size) / seconds


def throughput_percentiles(step_seconds, batch_size, percentiles=(50, 90)):
    """Percentiles of per-step examples/s; p90 is the fast end (90% of steps are slower).

    Args:
        step_seconds: sequence of post-warm-up step durations in seconds.
        batch_size: examples per step.
        percentiles: which percentiles (0-100) to return.

    Returns:
        A dict `{"p50": ..., "p90": ..., "steps": n}` (keys `f"p{q}"`), examples/s.

    Raises:
        ValueError: as `examples_per_second`.

    Example:

    >>> throughput_percentiles([0.5, 0.25], batch_size=10, percentiles=(100,))
    {'p100': 40.0, 'steps': 2}
    """
    rates = examples_per_second(step_seconds, batch_size)
    stats = {f"p{q:g}": float(np.percentile(rates, q)) for q in percentiles}
    stats["steps"] = int(rates.size)
    return stats


def global_step_seconds(per_rank_step_seconds):
    """The step times of a data-parallel run: for each step, its slowest rank's.

    A synchronous step ends with its last rank; percentiles of per-rank
    throughput never add up to a global one.

    Args:
        per_rank_step_seconds: one sequence of step times per rank, same length.

    Returns:
        A float64 numpy array of per-step global step times.

    Raises:
        ValueError: not one equal-length sequence per rank.

    Example:

    >>> global_step_seconds([[1.0, 2.0], [1.5, 1.0]]).tolist()
    [1.5, 2.0]
    """
    table = np.asarray(per_rank_step_seconds, dtype=np.float64)
    if table.ndim != 2:
        raise ValueError(
            "`per_rank_step_seconds` must be one equal-length sequence of step times per "
            f"rank. Received: an array of shape {table.shape}"
        )
    return table.max(axis=0)

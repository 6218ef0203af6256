"""Torch CPU intra-op thread policy of the ERASE train step.

`EraseModel(intra_op_threads=...)`:

- `"auto"` (default): a schedule with the `"worker"` launcher on CPU
  (`"threaded"`) runs the main thread (forward passes, main backward) and the
  backward worker thread at `threads_for_worker()` threads each (half the
  cores), so the two split the machine instead of oversubscribing it; other
  schedules keep the current count.
- an int: that count for the main thread in every torch schedule, and for the
  worker thread.
- `None`: never touches thread counts.

OpenMP teams are per thread: the worker thread sets its own count, in its own
thread (`keras_erase.torch.schedules.worker`). Whatever is changed on the
main thread is restored when `fit` or `train_on_batch` returns.
"""

import contextlib
import os

import torch

__all__ = [
    "main_thread_count", "restored_intra_op_threads", "set_intra_op_threads", "threads_for_worker",
    "worker_thread_count",
]


def threads_for_worker():
    """Returns the intra-op threads of each thread of the threaded schedule: half the cores."""
    return max(1, (os.cpu_count() or 1) // 2)


def set_intra_op_threads(n):
    """Sets torch's intra-op thread count of the calling thread if `n` differs from it."""
    if n is not None and int(n) != torch.get_num_threads():
        torch.set_num_threads(int(n))


def main_thread_count(schedule, policy, cuda):
    """Returns the main thread's intra-op count for `schedule` under `policy` (`None`: leave it).

    `schedule`: the step's `keras_erase.config.Schedule` (`None`: the standard step).
    """
    if policy is None:
        return None
    if policy == "auto":
        worker = schedule is not None and schedule.launcher == "worker"
        return threads_for_worker() if worker and not cuda else None
    return int(policy)


def worker_thread_count(policy, cuda):
    """Returns the threaded worker's own intra-op count under `policy` (`None`: leave it)."""
    if policy is None:
        return None
    if policy == "auto":
        return None if cuda else threads_for_worker()
    return int(policy)


@contextlib.contextmanager
def restored_intra_op_threads():
    """Restores the calling thread's torch intra-op count on exit."""
    before = torch.get_num_threads()
    try:
        yield before
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)

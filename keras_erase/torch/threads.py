"""torch CPU intra-op threads of the ERASE step: `EraseModel(intra_op_threads=...)`.

`"auto"`: on CPU a `"worker"` schedule runs the main and the worker thread
at half the cores each, other schedules keep the count; an int: that count
for both; `None`: never touched. The main thread's count is restored when
`fit` or `train_on_batch` returns.
"""

import contextlib
import os

import torch

__all__ = [
    "main_thread_count", "restored_intra_op_threads", "set_intra_op_threads", "threads_for_worker",
    "worker_thread_count",
]


def threads_for_worker():
    return max(1, (os.cpu_count() or 1) // 2)


def set_intra_op_threads(n):
    if n is not None and int(n) != torch.get_num_threads():
        torch.set_num_threads(int(n))


def main_thread_count(schedule, policy, cuda):
    """The main thread's count for `schedule` (`None`: the standard step) under `policy`; `None`: leave it."""
    if policy is None:
        return None
    if policy == "auto":
        worker = schedule is not None and schedule.launcher == "worker"
        return threads_for_worker() if worker and not cuda else None
    return int(policy)


def worker_thread_count(policy, cuda):
    """The worker's own count under `policy`; `None`: leave it."""
    if policy is None:
        return None
    if policy == "auto":
        return None if cuda else threads_for_worker()
    return int(policy)


@contextlib.contextmanager
def restored_intra_op_threads():
    before = torch.get_num_threads()
    try:
        yield before
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)

"""`make_schedule_run`: the `ScheduleRun` (a schedule at run time) of a `keras_erase.config.Schedule`."""

from keras_erase.torch.cuda_graphs.runner import DEFAULT_WARMUP
from keras_erase.torch.cuda_graphs.runner import CudaGraphRunner
from keras_erase.torch.schedules.base import ScheduleRun
from keras_erase.torch.schedules.launchers import make_launcher
from keras_erase.torch.schedules.placements import make_placement

__all__ = ["make_schedule_run"]


def make_schedule_run(
    schedule, num_streams=None, worker_threads=None, streams=None, graph_capture=None,
    graph_warmup=None,
):
    """Builds the `ScheduleRun` of `schedule`; a graphed one gets a `CudaGraphRunner` as `graphs`.

    `num_streams`: the block-stream cap; `worker_threads`: the worker's
    intra-op threads; `streams`: the stream API of `"block_streams"`.
    """
    block_streams = schedule.placement == "block_streams"
    schedule_run = ScheduleRun(
        make_launcher(schedule.launcher, threads=worker_threads),
        make_placement(schedule.placement, num_streams=num_streams,
                       api=streams if block_streams else None),
    )
    if schedule.graphs:
        warmup = DEFAULT_WARMUP if graph_warmup is None else graph_warmup
        schedule_run.graphs = CudaGraphRunner(capture=graph_capture, warmup=warmup,
                                            backward_on_worker=schedule.launcher == "worker")
    return schedule_run

"""`ScheduleRun`: a `Schedule` at run time, a launcher x a placement.

Per step: `run_block(block, inputs, y_true, sample_weight, scale_loss)` runs
the block's forward and local objective (through `graphs` when set) and has
the launcher launch the backward of `scale_loss(objective)`, which ends at
the block's input (`keras_erase.torch.handoff`); `final_backward(main_loss)`
runs the main loss's backward (after the block backwards that write a
`.grad` it writes too), joins the blocks and runs the shared upstream once; `finish()` re-raises the first block error (the worker keeps
serving); `abort()` swallows it; `close()` ends the worker and the graphs.
"""

import threading
import time

import torch

from keras_erase.torch.handoff import GradientHandOff
from keras_erase.torch.schedules.launchers import InlineLauncher
from keras_erase.torch.schedules.main_backward import main_backward_to_handoff
from keras_erase.torch.schedules.placements import DefaultStream
from keras_erase.torch.tensors import detach_tensors
from keras_erase.torch.tensors import flat_tensors

__all__ = ["ScheduleRun", "forward_block"]


def forward_block(block, inputs, y_true, sample_weight):
    """Runs `block` eagerly; returns `(outputs, local objective)`."""
    outputs = block.forward_layer(inputs, training=True)
    loss = block.local_objective(y_true, outputs, sample_weight)
    return outputs, loss


class ScheduleRun:
    """One schedule: `launcher` x `placement`; `trace`: a list for events (`EraseModel.start_trace`)."""

    def __init__(self, launcher=None, placement=None):
        self.launcher = launcher if launcher is not None else InlineLauncher()
        self.placement = placement if placement is not None else DefaultStream()
        self.trace = None
        # Called as `after_backward(block)` right after each block's backward, on the
        # thread (and CUDA stream) that ran it, in block order (used for the
        # torch.distributed gradient all-reduce; see `keras_erase.torch.distributed`).
        self.after_backward = None
        # A `CudaGraphRunner` (`keras_erase.torch.cuda_graphs.runner`), set by
        # `make_schedule_run` for a graphed schedule: every block forward goes through it.
        self.graphs = None
        # One thread and one stream run every block backward in order: the hand-off
        # sums each input gradient right there; otherwise on the main stream at the end.
        self.handoff = GradientHandOff(accumulate=self.placement.one_stream)

    @property
    def name(self):
        return f"{self.launcher.name}+{self.placement.name}"

    @property
    def _worker(self):
        return self.launcher.worker

    def _record(self, block, phase, start, end=None):
        if self.trace is not None:
            self.trace.append(
                {
                    "block": block.name,
                    "phase": phase,
                    "start": start,
                    "end": start if end is None else end,
                    "thread": threading.get_ident(),
                }
            )

    def _timed_forward(self, block, inputs, y_true, sample_weight):
        """The block's forward on its cut inputs; returns `(outputs, loss, cuts)`."""
        start = time.perf_counter()
        cuts = []
        if not block.detach_input:
            inputs, cuts = self.handoff.cut(inputs)
        with torch.profiler.record_function(f"{block.name}/forward"):
            if self.graphs is None:
                outputs, loss = forward_block(block, inputs, y_true, sample_weight)
            else:
                outputs, loss = self.graphs.forward(
                    block, inputs, y_true, sample_weight, forward_block
                )
        self._record(block, "forward", start, time.perf_counter())
        return outputs, loss, cuts

    def _timed_backward(self, block, loss, cuts=()):
        """The block's backward, on the launcher's thread in the placement's backward scope."""
        start = time.perf_counter()
        # The block's graph ends at its (cut) inputs: nothing outside the block runs.
        with torch.profiler.record_function(f"{block.name}/backward"):
            torch.autograd.backward(loss)
        self.placement.protect_gradients(block, cuts)
        self._hand_over(cuts)
        self._record(block, "backward", start, time.perf_counter())
        if self.after_backward is not None:  # the all-reduce's launch (torch.distributed)
            start = time.perf_counter()
            self.after_backward(block)
            self._record(block, "all_reduce", start, time.perf_counter())

    def _hand_over(self, cuts):
        self.handoff.deliver(cuts)

    def run_block(self, block, inputs, y_true, sample_weight, scale_loss):
        placement = self.placement
        inputs, y_true, sample_weight = placement.enter(block, (inputs, y_true, sample_weight))
        with placement.forward_scope(block):
            outputs, loss, cuts = self._timed_forward(block, inputs, y_true, sample_weight)
            scaled = scale_loss(loss) if loss.requires_grad else None
            ready = placement.forward_done(block)
        outputs, detached = detach_tensors(outputs), loss.detach()
        placement.to_main(flat_tensors(outputs) + [detached], ready)
        if scaled is not None:
            self._record(block, "submit", time.perf_counter())
            self.launcher.launch(self._backward_job(block, scaled, cuts, ready))
        return outputs, detached

    def _backward_job(self, block, scaled, cuts, ready):
        placement = self.placement

        def job():
            with placement.backward_scope(block, ready):
                self._timed_backward(block, scaled, cuts)

        return job

    def finish(self):
        try:
            self.launcher.wait()  # every backward launched before the streams are joined
            self.placement.join()
        finally:
            if self.graphs is not None:
                self.graphs.end_step()

    def final_backward(self, loss, early_main=True):
        """The main `loss` (or `None`), the join, then the handed-over gradients.

        With `early_main` the main loss's part runs before the join where its
        graph allows (`main_backward_to_handoff`).
        """
        runs = loss is not None and loss.requires_grad
        if runs and self.placement.orders_main:  # a `.grad` a block's stream writes too
            self.launcher.wait()
            self.placement.before_main_backward()
        if not self.handoff.pending:
            if runs:
                loss.backward()
            self.finish()
            return
        if runs and early_main:
            handed = main_backward_to_handoff(loss, self.handoff.sources())
            if handed is not None:
                for source, grad in handed:
                    self.handoff.add(source, grad)
                loss = None
        self.finish()
        self.handoff.backward(loss)

    def abort(self):
        try:
            self.finish()
        except Exception:  # the step already failed; keep its error
            pass
        self.handoff.clear()

    def close(self):
        self.launcher.close()
        self.placement.close()
        if self.graphs is not None:
            self.graphs.close()

"""`Dispatcher`: the base of every ERASE schedule (forward, early backward, hand-off, trace).

A dispatcher runs each `DetachBlock` met by the torch ERASE step (see
`keras_erase.torch.schedules` for the schedules and their contract). The base
class owns what every schedule shares:

- the block's forward pass and local objective, through the dispatcher's CUDA
  Graph runner when it has one (`graphs`, see
  `keras_erase.torch.cuda_graphs.runner`);
- the early backward of the local objective, which ends at the block's input:
  for a `detach_input=False` block the inputs are cut (`keras_erase.torch.handoff`)
  before the forward and their gradients handed over after the backward, so
  the shared upstream runs one backward per step (`final_backward`);
- the optional trace of forward/backward intervals and the `after_backward`
  hook (the torch.distributed all-reduce of the block's gradients);
- `close()`: drops the block graphs (and their memory pools).

Example:

```python
dispatcher = make_dispatcher("blocking")
outputs, loss = dispatcher.run_block(block, inputs, y, None, lambda v: v)
dispatcher.final_backward(main_loss)   # waits the blocks, one upstream backward
```
"""

import threading
import time

import torch

from keras_erase.torch.handoff import GradientHandOff

__all__ = ["Dispatcher", "forward_block"]


def forward_block(block, inputs, y_true, sample_weight):
    """Runs `block` eagerly; returns `(outputs, local objective)` (layer, head, local losses)."""
    outputs = block.forward_layer(inputs, training=True)
    loss = block.local_objective(y_true, outputs, sample_weight)
    return outputs, loss


class Dispatcher:
    """Base class of the schedules (see the module docstring).

    Set `trace` to a list to record events: dicts with `block`, `phase`
    (`"forward"`, `"submit"` or `"backward"`), `start`, `end`
    (`time.perf_counter()` seconds) and `thread` (thread id).
    """

    name = "base"
    # Whether one thread runs every block backward in order (the hand-off then sums
    # each input gradient right there); False for one stream per block.
    sums_on_block_thread = True

    def __init__(self):
        self.trace = None
        # Called as `after_backward(block)` right after each block's backward, on the
        # thread (and CUDA stream) that ran it, in block order (used for the
        # torch.distributed gradient all-reduce; see `keras_erase.torch.distributed`).
        self.after_backward = None
        # A `CudaGraphRunner` (`keras_erase.torch.cuda_graphs.runner`), set by
        # `make_dispatcher` when `cuda_graphs=True`: every mode's block forward then
        # goes through it.
        self.graphs = None
        self.handoff = GradientHandOff(accumulate=self.sums_on_block_thread)

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
        """Runs the block's forward on its cut inputs (`handoff`); returns `(outputs, loss, cuts)`."""
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
        start = time.perf_counter()
        # The block's graph ends at its (cut) inputs: nothing outside the block runs.
        with torch.profiler.record_function(f"{block.name}/backward"):
            torch.autograd.backward(loss)
        self._hand_over(cuts)
        self._record(block, "backward", start, time.perf_counter())
        if self.after_backward is not None:
            self.after_backward(block)

    def _hand_over(self, cuts):
        """Delivers the block's input gradients to the hand-off (after its backward)."""
        self.handoff.deliver(cuts)

    def run_block(self, block, inputs, y_true, sample_weight, scale_loss):
        raise NotImplementedError

    def finish(self):
        """Waits for every block backward of the step (re-raising the first error); ends the step."""
        try:
            self._wait()
        finally:
            if self.graphs is not None:
                self.graphs.end_step()

    def _wait(self):
        """Waits for the step's block backwards (the schedule's own part of `finish`)."""

    def final_backward(self, loss):
        """Ends the step's backward: runs the main `loss` (or `None`) and the handed-over gradients.

        Without a hand-off (every block detaches its input) the main backward
        runs first, overlapping the blocks still running, then `finish()`.
        Otherwise `finish()` first, then one backward of the loss and the
        upstream tensors with their summed input gradients.
        """
        if not self.handoff.pending:
            if loss is not None and loss.requires_grad:
                loss.backward()
            self.finish()
            return
        self.finish()
        self.handoff.backward(loss)

    def abort(self):
        try:
            self.finish()
        except Exception:  # the step already failed; keep its error
            pass
        self.handoff.clear()

    def close(self):
        """Releases the dispatcher's resources: its block graphs (a later step recaptures)."""
        if self.graphs is not None:
            self.graphs.close()

"""The gradient hand-off: a `detach_input=False` block's early backward stops at its input.

A block that does not detach its input shares the layers upstream of it (an
embedding table, a stem) with the main loss and with the other blocks. If its
early backward ran through them, the upstream's backward would run once per
block per step (six dense embedding-table gradients per step on the CTR
example instead of one), and on CUDA a block's side-stream backward would
reach main-stream autograd nodes, which serialises the streams.

Instead, per step and per dispatcher (`GradientHandOff`):

1. `cut(inputs)` (main thread, before the block's forward): every input
   tensor that requires grad is replaced by a fresh leaf (`detach()` +
   `requires_grad_()`), remembered with the upstream tensor it stands for.
   The block's autograd graph therefore ends at those leaves: its early
   backward touches only the block's own nodes and weights.
2. `deliver(cuts)` (right after the block's backward, on the block's thread
   and stream): each leaf's `.grad` (dL_block/d input) is handed over, summed
   per upstream tensor. With `accumulate=True` (blocking, threaded: one thread
   runs every block backward, in order) the sum is done there; otherwise
   (streams, one stream per block) the gradients are kept and summed on the
   main stream at the end of the step, after it waited for every block stream.
3. `backward(loss)` (main thread, after the blocks finished): one
   `torch.autograd.backward` call over the main loss and every upstream tensor
   with its summed gradient. The upstream's backward runs once per step in
   every schedule, with the same gradients as the standard step (the sum of
   every loss's gradient) to float rounding.

Example:

>>> import torch
>>> w = torch.ones(3, requires_grad=True)
>>> h = w * 2.0                                   # the shared upstream
>>> handoff = GradientHandOff()
>>> (leaf,), cuts = handoff.cut((h,))
>>> (leaf * 3.0).sum().backward()                 # a block's early backward
>>> handoff.deliver(cuts)
>>> handoff.backward(None)                        # one upstream backward
>>> w.grad.tolist()
[6.0, 6.0, 6.0]
"""

import threading

import torch

from keras_erase.torch.tensors import map_tensors

__all__ = ["GradientHandOff"]


class GradientHandOff:
    """Input gradients of the `detach_input=False` blocks of one step (see the module docstring).

    Args:
        accumulate: sum each gradient into its upstream tensor's total as it
            is delivered (one thread delivers, in order); `False` keeps them
            and sums on the calling thread in `backward` (several streams).
    """

    def __init__(self, accumulate=True):
        self.accumulate = bool(accumulate)
        self._lock = threading.Lock()
        self._sources = {}  # id(upstream tensor) -> upstream tensor
        self._grads = {}  # id(upstream tensor) -> summed gradient, or list of gradients
        self.cuts = 0  # blocks cut this step

    @property
    def pending(self):
        """Whether a block of this step was cut (its upstream then waits for `backward`)."""
        return self.cuts > 0

    def cut(self, inputs):
        """Replaces each grad-requiring tensor of `inputs` by a leaf; returns `(inputs, cuts)`.

        `cuts` is the list of `(upstream tensor, leaf)` pairs to `deliver` after
        the block's backward.
        """
        cuts = []

        def leaf(t):
            if not t.requires_grad:
                return t
            fresh = t.detach().requires_grad_(True)
            cuts.append((t, fresh))
            return fresh

        result = map_tensors(leaf, inputs)
        if cuts:
            with self._lock:
                self.cuts += 1
                for source, _ in cuts:
                    self._sources.setdefault(id(source), source)
        return result, cuts

    def deliver(self, cuts):
        """Hands over each leaf's gradient (called right after the block's backward)."""
        for source, leaf in cuts:
            grad = leaf.grad
            leaf.grad = None
            if grad is None:  # the local loss does not depend on this input
                continue
            self.add(source, grad)

    def sources(self):
        """Returns the upstream tensors cut this step (in order of first cut)."""
        with self._lock:
            return list(self._sources.values())

    def add(self, source, grad):
        """Adds `grad` (e.g. the main loss's, `schedules.main_backward`) to `source`'s hand-off."""
        key = id(source)
        with self._lock:
            self._sources.setdefault(key, source)
            total = self._grads.get(key)
            if not self.accumulate:
                self._grads.setdefault(key, []).append(grad)
            elif total is None:
                self._grads[key] = grad
            else:
                self._grads[key] = total + grad

    def gradients(self):
        """Returns `(upstream tensors, summed gradients)` of this step; clears the hand-off."""
        with self._lock:
            sources, grads = self._sources, self._grads
            self._sources, self._grads, self.cuts = {}, {}, 0
        tensors, totals = [], []
        for key, grad in grads.items():
            if isinstance(grad, list):
                total = grad[0]
                for g in grad[1:]:
                    total = total + g
                grad = total
            tensors.append(sources[key])
            totals.append(grad)
        return tensors, totals

    def backward(self, loss):
        """Runs one backward of `loss` (or `None`) and the handed-over gradients; clears them."""
        tensors, grads = self.gradients()
        if loss is not None and loss.requires_grad:
            tensors, grads = [loss] + tensors, [None] + grads
        if tensors:
            torch.autograd.backward(tensors, grad_tensors=grads)

    def clear(self):
        """Drops the step's hand-off (the step failed)."""
        self.gradients()

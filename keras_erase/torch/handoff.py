"""The gradient hand-off: a `detach_input=False` block's early backward stops at its input.

`cut` replaces the block's grad-requiring inputs by fresh leaves before its
forward; `deliver` hands each leaf's gradient over after its backward,
summed per upstream tensor; `backward` runs the main loss and the upstream
once, with the sums (docs/erase.md, "Shared upstream layers train once").

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
    """One step's input gradients of `detach_input=False` blocks; `accumulate`: one thread delivers."""

    def __init__(self, accumulate=True):
        self.accumulate = bool(accumulate)
        self._lock = threading.Lock()
        self._sources = {}  # id(upstream tensor) -> upstream tensor
        self._grads = {}  # id(upstream tensor) -> summed gradient, or list of gradients
        self.cuts = 0  # blocks cut this step

    @property
    def pending(self):
        return self.cuts > 0

    def cut(self, inputs):
        """Replaces each grad-requiring input by a leaf; returns `(inputs, [(upstream tensor, leaf)])`."""
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
        for source, leaf in cuts:
            grad = leaf.grad
            leaf.grad = None
            if grad is None:  # the local loss does not depend on this input
                continue
            self.add(source, grad)

    def sources(self):
        with self._lock:
            return list(self._sources.values())

    def add(self, source, grad):
        """Adds `grad` (a block's, or the main loss's) to `source`'s hand-off."""
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
        """`(upstream tensors, summed gradients)` of this step; clears the hand-off."""
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
        tensors, grads = self.gradients()
        if loss is not None and loss.requires_grad:
            tensors, grads = [loss] + tensors, [None] + grads
        if tensors:
            torch.autograd.backward(tensors, grad_tensors=grads)

    def clear(self):
        self.gradients()

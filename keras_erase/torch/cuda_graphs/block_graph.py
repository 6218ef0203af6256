"""One block's captured graphs (`BlockGraph`) and the autograd node that replays them (`ReplayBlock`)."""

import torch

from keras_erase._keras_private import uncast_value
from keras_erase.torch.tensors import is_tensor
from keras_erase.torch.tensors import same_storage

__all__ = ["BlockGraph", "ReplayBlock", "input_signature", "trainable_params"]


def input_signature(block, flat):
    """The key of a block's graphs: the block and its flat inputs' shapes, dtypes, devices and grads."""
    return (id(block),) + tuple(
        (tuple(t.shape), t.dtype, t.device, bool(t.requires_grad)) if is_tensor(t) else repr(t)
        for t in flat
    )


def trainable_params(block):
    """The block's distinct trainable parameters that require a gradient (not autocast copies)."""
    values = [uncast_value(v) for v in block.trainable_weights]
    unique = {id(p): p for p in values if is_tensor(p) and p.requires_grad}
    return list(unique.values())


class BlockGraph:
    def __init__(self, block, static_inputs, params, forward, backward, grad_loss, grad_slots,
                 output_structure=None):
        self.block = block
        self.output_structure = output_structure
        self.static_inputs = static_inputs
        self.params = params
        self.param_ptrs = [p.data_ptr() for p in params]
        self.forward = forward  # Capture: outputs = (flat block outputs..., loss)
        self.backward = backward  # Capture: outputs = gradients (None where unused)
        self.grad_loss = grad_loss
        self.grad_slots = grad_slots  # per static input: index into backward outputs or None

    def stale(self):
        """Whether the block's trainable weights were re-created or (un)frozen since capture."""
        current = trainable_params(self.block)
        return [id(p) for p in current] != [id(p) for p in self.params] or any(
            p.data_ptr() != ptr for p, ptr in zip(self.params, self.param_ptrs)
        )

    def release(self):
        for capture in (self.forward, self.backward):
            if capture is not None:
                capture.release()
        self.forward = self.backward = None
        self.static_inputs = self.params = []
        self.grad_loss = None

    def load(self, flat_inputs):
        with torch.no_grad():
            for static, value in zip(self.static_inputs, flat_inputs):
                if is_tensor(static) and not same_storage(static, value):
                    static.copy_(value, non_blocking=True)


class ReplayBlock(torch.autograd.Function):
    """One autograd node replaying a block's graphs.

    Forward: copies the step's tensors into the static inputs, replays the
    forward graph. Backward: copies the loss gradient in, replays the backward
    graph and returns copies of the gradients (a static buffer returned would
    become `.grad`, overwritten by the next replay).
    """

    @staticmethod
    def forward(ctx, graph, runner, *tensors):
        n = len(graph.static_inputs)
        graph.load(tensors[:n])
        graph.forward.replay()
        runner.count("replays")
        ctx.graph, ctx.runner = graph, runner
        *outputs, loss = graph.forward.outputs
        outputs = [o.clone() for o in outputs]
        ctx.mark_non_differentiable(*outputs)
        return (*outputs, loss.clone())

    @staticmethod
    def backward(ctx, *grads):
        graph = ctx.graph
        grad_loss = grads[-1]
        with torch.no_grad():
            if grad_loss is None:
                graph.grad_loss.zero_()
            else:
                graph.grad_loss.copy_(grad_loss)
        graph.backward.replay()
        ctx.runner.count("backward_replays")
        results = graph.backward.outputs
        # Copies, never the static buffers: autograd's AccumulateGrad adopts a
        # returned tensor as `param.grad`, and the next replay (the same block met
        # again, or the next step) overwrites the static buffer in place.
        input_grads = [
            None if slot is None or results[slot] is None else results[slot].clone()
            for slot in graph.grad_slots
        ]
        n_params = len(graph.params)
        param_grads = [
            None if g is None else g.clone() for g in results[len(results) - n_params :]
        ]
        return (None, None, *input_grads, *param_grads)

"""`CudaGraphRunner`: captures each block's forward + local loss and its backward once, then replays them.

What a block needs for graphs: docs/erase.md, "Schedules".
"""

import contextlib
import logging
import threading
import weakref

import torch
from keras import tree

from keras_erase.torch.cuda_graphs.block_graph import BlockGraph
from keras_erase.torch.cuda_graphs.block_graph import ReplayBlock
from keras_erase.torch.cuda_graphs.block_graph import input_signature
from keras_erase.torch.cuda_graphs.block_graph import trainable_params
from keras_erase.torch.cuda_graphs.capture import default_capture
from keras_erase.torch.cuda_graphs.op_recording import CaptureRefused
from keras_erase.torch.cuda_graphs.op_recording import OpTape
from keras_erase.torch.cuda_graphs.op_recording import describe_op
from keras_erase.torch.cuda_graphs.op_recording import forbidden_ops
from keras_erase.torch.tensors import is_tensor

__all__ = ["DEFAULT_WARMUP", "CudaGraphRunner", "held_weights", "live_runners", "untimed_steps"]

LOGGER = logging.getLogger("keras_erase")

# Eager steps per block and input signature before its graphs are captured.
DEFAULT_WARMUP = 2
_RUNNERS = weakref.WeakSet()


def _flat(structure):
    return list(tree.flatten(structure)) if structure is not None else []


def live_runners():
    """Every `CudaGraphRunner` still alive (benchmarks read their counters)."""
    return list(_RUNNERS)


def untimed_steps(warmup):
    """The steps of one schedule that include graph warm-up or capture (never timed)."""
    return int(warmup) + 1


def held_weights(block):
    """Paths of `block`'s trainable weights whose gradient accumulator another autograd graph holds.

    A capture reaching one would wait on an event of another stream, which
    invalidates it. Probed without side effects.
    """
    from torch.autograd.graph import get_gradient_edge

    held = []
    for variable in block.trainable_weights:
        param = variable.value
        if not (is_tensor(param) and param.requires_grad and param.is_leaf):
            continue
        node = get_gradient_edge(param).node
        node.metadata["keras_erase_probe"] = True
        del node
        node = get_gradient_edge(param).node  # the same node only if something else holds it
        if node.metadata.pop("keras_erase_probe", False):
            held.append(variable.path)
        del node
    return held


class CudaGraphRunner:
    """Per block, signature and occurrence in the step: `warmup` eager steps, one capture, then replays.

    The last eager step is checked against what a capture refuses; replays go
    through `ReplayBlock`. A failed capture turns graphs off for the run
    (`disabled`); a block that cannot be graphed is `refused` (with the reason).
    """

    def __init__(self, capture=None, warmup=DEFAULT_WARMUP, backward_on_worker=False):
        self._capture = capture if capture is not None else default_capture()
        self.warmup = int(warmup)
        self.backward_on_worker = bool(backward_on_worker)
        self.refused = {}  # block name -> why it runs eagerly (the other blocks keep their graphs)
        self._refused_ids = set()
        self.captures = 0
        self.replays = 0
        self.backward_replays = 0
        self.failures = 0
        self.disabled = False
        self.disabled_reason = None
        self._seen = {}
        self._graphs = {}
        self._occurrences = {}  # this step: how often each block and signature was met
        self._streams = {}  # id(block) -> the block's capture stream
        self._lock = threading.Lock()
        self._function = ReplayBlock
        _RUNNERS.add(self)

    def count(self, name):
        """Adds one to the counter `name` (`replays`, `backward_replays`, ...), thread-safe."""
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def disable(self, reason):
        """Turns graphs off for the rest of the run (logged once) and drops every graph."""
        if not self.disabled:
            self.disabled = True
            self.disabled_reason = reason
            LOGGER.warning(
                "keras_erase: CUDA Graphs disabled for the rest of the run (%s); "
                "every block now runs eagerly.",
                reason,
            )
        # Dropped, not released: a backward of this step may still replay one of them
        # (on the worker); each graph is freed with its last reference.
        self._graphs = {}

    def refuse(self, block, reason):
        """Runs `block` eagerly from now on (logged once with `reason`)."""
        if id(block) in self._refused_ids:
            return
        self._refused_ids.add(id(block))
        self.refused[block.name] = reason
        LOGGER.warning(
            "keras_erase: CUDA Graphs refused for block %r: %s. It trains eagerly; the other "
            "blocks keep their graphs.", block.name, reason,
        )
        for key in [k for k in self._graphs if k[0] == id(block)]:
            self._graphs.pop(key)  # dropped, not released: a queued backward may replay it

    def pools(self):
        return list({g.forward.pool for g in self._graphs.values() if g.forward is not None})

    def _release_graphs(self):
        graphs, self._graphs = list(self._graphs.values()), {}
        for graph in graphs:
            graph.release()

    def capture_stream(self, block):
        """The block's own capture stream, made at first use (`None` if the capture makes none)."""
        key = id(block)
        if key not in self._streams:
            new_stream = getattr(self._capture, "new_stream", None)
            self._streams[key] = new_stream() if new_stream is not None else None
        return self._streams[key]

    def _captured(self, fn, pool, block):
        stream = self.capture_stream(block)
        if stream is None:
            return self._capture(fn, pool)
        return self._capture(fn, pool, stream=stream)

    def end_step(self):
        self._occurrences.clear()

    def forward(self, block, inputs, y_true, sample_weight, eager_forward):
        """Runs `block` and returns `(outputs, local_loss)`, from its graphs once captured.

        `eager_forward(block, inputs, y_true, sample_weight)`: the `ScheduleRun`'s
        eager forward, which is what gets captured.
        """
        if self.disabled or id(block) in self._refused_ids:
            return eager_forward(block, inputs, y_true, sample_weight)
        flat = _flat(inputs) + _flat(y_true) + _flat(sample_weight)
        signature = input_signature(block, flat)
        # A block met several times in a step (a shared tower) gets one graph pair per
        # occurrence: its own static inputs and saved activations, so a later
        # occurrence's forward replay never overwrites what an earlier one's backward
        # replay (maybe still queued on the worker) reads.
        occurrence = self._occurrences.get(signature, 0)
        self._occurrences[signature] = occurrence + 1
        if occurrence and self.backward_on_worker:
            # The earlier call's backward, queued on the worker, holds the weights' gradient
            # accumulators (made on the main stream); a capture of this call would make that
            # stream wait on an event recorded inside the capture, which breaks it.
            self.refuse(block, f"it is called {occurrence + 1} times in a step while its "
                               "backwards run on a worker thread (the earlier call's backward "
                               "may still hold its weights when the next call is captured)")
            return eager_forward(block, inputs, y_true, sample_weight)
        key = signature + (occurrence,)
        graph = self._graphs.get(key)
        if graph is not None and graph.stale():  # weights re-created or (un)frozen: capture again
            del self._graphs[key]
            graph.release()
            graph = None
            self._seen[key] = self.warmup
        if graph is None:
            count = self._seen.get(key, 0) + 1
            self._seen[key] = count
            if count < self.warmup:
                return eager_forward(block, inputs, y_true, sample_weight)
            if count == self.warmup:  # the last eager step also checks what capture would refuse
                return self._checked_eager(block, inputs, y_true, sample_weight, eager_forward)
            held = held_weights(block)
            if held:
                self.refuse(block, f"its weights {held} are held by another autograd graph when "
                                   "it is captured (used outside the block or by another "
                                   "block): a capture would wait on their streams")
                return eager_forward(block, inputs, y_true, sample_weight)
            try:
                graph = self._capture_block(block, inputs, y_true, sample_weight, eager_forward)
            except Exception as error:  # noqa: BLE001 - eager is always correct
                self.failures += 1
                self.disable(
                    f"capture of block {block.name!r} failed: {type(error).__name__}: {error}"
                )
                return eager_forward(block, inputs, y_true, sample_weight)
            self._graphs[key] = graph
            self.captures += 1
        if block.detach_input:
            # No input gradient, so no edge into the upstream graph either (as the eager
            # block's stop-gradient): another block's backward may have freed it.
            flat = [t.detach() if is_tensor(t) else t for t in flat]
        results = self._function.apply(graph, self, *flat, *graph.params)
        *outputs, loss = results
        return tree.pack_sequence_as(graph.output_structure, list(outputs)), loss

    def _checked_eager(self, block, inputs, y_true, sample_weight, eager_forward):
        """An eager forward whose ops, if a capture could not hold them, turn graphs off."""
        tape = OpTape(refuse=False)
        stream = self.capture_stream(block)
        scope = getattr(self._capture, "warmup_scope", None)
        with contextlib.ExitStack() as stack:
            to_caller = None
            if stream is not None and scope is not None:  # warm up on the capture stream
                to_caller = stack.enter_context(
                    scope(stream, _flat(inputs) + _flat(y_true) + _flat(sample_weight))
                )
            with tape:
                result = eager_forward(block, inputs, y_true, sample_weight)
            if to_caller is not None:
                to_caller(_flat(result[0]) + [result[1]])
        found = forbidden_ops(tape.names)
        if found:
            self.failures += 1
            self.disable(
                f"block {block.name!r} runs {', '.join(describe_op(n) for n in found)} in its "
                "forward or local loss (a tensor made from host data, a host read or a host sync), "
                "which a CUDA Graph cannot capture"
            )
        return result

    def _capture_block(self, block, inputs, y_true, sample_weight, eager_forward):
        def static_copy(t):
            if not is_tensor(t):
                return t
            copy = t.detach().clone()
            # A detach_input=False block's inputs require grad; so must the sample.
            return copy.requires_grad_(t.requires_grad) if t.is_floating_point() else copy

        s_inputs = tree.map_structure(static_copy, inputs)
        s_y = None if y_true is None else tree.map_structure(static_copy, y_true)
        s_sw = None if sample_weight is None else tree.map_structure(static_copy, sample_weight)
        static_inputs = _flat(s_inputs) + _flat(s_y) + _flat(s_sw)
        params = trainable_params(block)
        needs_grad = [i for i, t in enumerate(static_inputs) if is_tensor(t) and t.requires_grad]

        def run_forward():
            with torch.enable_grad():
                outputs, loss = eager_forward(block, s_inputs, s_y, s_sw)
            flat_out = [o.detach() for o in _flat(outputs)]
            return (*flat_out, loss), outputs

        structure = {}

        def forward_region():
            flat_out, outputs = run_forward()
            structure["outputs"] = outputs
            return flat_out

        # One memory pool per block, shared by its forward and backward graph only: a
        # pool may be shared only by graphs replayed in capture order and never
        # concurrently, and ERASE replays other blocks' graphs between a block's
        # forward and its backward (and concurrently, on the worker or other streams).
        forward = self._captured(forward_region, None, block)
        loss = forward.outputs[-1]
        if not loss.requires_grad:
            raise CaptureRefused(f"the local loss of block {block.name!r} does not require grad")
        grad_loss = torch.ones_like(loss).detach()
        wrt = [static_inputs[i] for i in needs_grad] + params

        def backward_region():
            grads = torch.autograd.grad(loss, wrt, grad_outputs=grad_loss, allow_unused=True)
            return tuple(None if g is None else g for g in grads)

        backward = self._captured(backward_region, forward.pool, block)
        # Keep nothing of the capture-time autograd graph but the static outputs.
        forward.outputs = tuple(o.detach() if is_tensor(o) else o for o in forward.outputs)
        del loss, wrt
        slots = [None] * len(static_inputs)
        for position, index in enumerate(needs_grad):
            slots[index] = position
        return BlockGraph(
            block, static_inputs, params, forward, backward, grad_loss, slots,
            output_structure=tree.map_structure(lambda _: 0, structure["outputs"]),
        )

    def close(self):
        self._release_graphs()
        self._seen.clear()
        self._occurrences.clear()
        self._streams.clear()

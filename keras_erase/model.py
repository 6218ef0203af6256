"""`EraseModel`: a `keras.Model` whose loss includes every `DetachBlock`'s local loss.

On every backend the total loss is the compiled (main) loss plus each block's
`loss_weight * loss(y_true, head(output))`, and `fit` logs each local loss as
`"<block name>_loss"` (a `keras.metrics.Mean`, reset every epoch). On JAX and
TensorFlow the standard train step trains the model. On torch, `train_step`
runs the ERASE schedule: each block's backward pass is launched right after
its forward pass and local loss (see `keras_erase.dispatch`), overlapping the
forward pass of later blocks; the gradients are those of the standard step.

Dispatch modes (torch):

- `"standard"`: Keras's stock step (the reference schedule).
- `"blocking"`: early backward inline on the main thread.
- `"threaded"`: early backward on one FIFO worker thread.
- `"streams"` (CUDA): each block on its own CUDA stream; `cuda_graphs=True`
  also captures each block as CUDA Graphs.
- `"auto"` (default): measures its first training steps and keeps the fastest
  schedule. Candidates on CPU: `"standard"` at the current torch thread count
  `T` and `"threaded"` at `min(T, threads_for_worker())` (at most half the
  cores: a worker whose OpenMP team spans the machine was measured to slow all
  later steps of the process, so it is not even tried). On CUDA: `"standard"`
  and `"streams"`.
  Steps are taken round robin over the candidates (so a slow drift of the
  machine's load hits every candidate alike); the first round is warm-up, the
  next `auto_steps` rounds (default 8) are timed. Rule: a candidate replaces
  the standard step (the first candidate) only if both its median and its
  90th-percentile step time are at least `AUTO_MARGIN` (3%) below the
  standard step's; among those, the smallest 90th percentile wins. The
  target is tail throughput (p90 examples/s) and a schedule that is not
  clearly faster on both counts is not worth its risk. The choice is logged
  on the `"keras_erase"` logger and kept in `model.dispatch_choice`, the
  timings (median and p90 seconds per candidate) in `model.auto_timings`.
  Every candidate computes the same gradients, so the measuring steps are
  ordinary training steps.

Intra-op threads (torch CPU): `torch.set_num_threads` is process-wide, so the
worker thread shares the main thread's pool. `intra_op_threads="auto"` uses
half the cores for `"threaded"` (the main thread's forward and the worker's
backward then split the machine instead of oversubscribing it) and leaves the
setting alone for the other modes; an int sets that count for every torch
mode; `None` never touches it. The thread count in place before `fit` is
restored when `fit` returns.
"""

import contextlib
import logging
import time

import keras
import numpy as np
from keras import ops
from keras import tree
from keras.src.models.functional import Functional

from keras_erase.detach_block import DetachBlock
from keras_erase.detach_block import step_handler

LOGGER = logging.getLogger("keras_erase")


DISPATCH_MODES = ("auto", "standard", "blocking", "threaded", "streams")

# "auto" leaves the standard step only for a schedule at least this much faster.
AUTO_MARGIN = 0.03
# Timed rounds per candidate for "auto" (after one warm-up round).
AUTO_STEPS = 8


class LocalLossValue:
    """A local loss already computed (and back-propagated) by the ERASE step."""

    def __init__(self, value):
        self.value = value


def _is_torch():
    return keras.backend.backend() == "torch"


def _functional_arguments(args, kwargs):
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


class _EraseStep:
    """Per-step handler the torch ERASE step installs for its `DetachBlock`s."""

    def __init__(self, model, dispatcher, y, sample_weight, scale_loss):
        self.model = model
        self.dispatcher = dispatcher
        self.y = y
        self.sample_weight = sample_weight
        self.scale_loss = scale_loss
        self.shares_graph = False

    def run_block(self, block, inputs):
        y_true, sample_weight = self.model._select_target(block, self.y, self.sample_weight)
        outputs, loss = self.dispatcher.run_block(
            block, inputs, y_true, sample_weight, self.scale_loss
        )
        self.shares_graph = self.shares_graph or not block.detach_input
        block._pending_predictions.append(LocalLossValue(loss))
        return outputs


@keras.saving.register_keras_serializable(package="keras_erase")
class EraseModel(keras.Model):
    """A Keras model trained with the ERASE early-backward schedule on torch.

    Functional (`EraseModel(inputs, outputs)`) or subclassed. Its loss is the
    compiled loss plus every `DetachBlock`'s local loss on every backend.

    Args:
        dispatch: `"auto"`, `"standard"`, `"blocking"`, `"threaded"` or
            `"streams"` (CUDA). Only used on torch; JAX and TensorFlow use the
            standard step.
        num_streams: number of CUDA streams for `"streams"` (round robin).
        cuda_graphs: capture each block as CUDA Graphs (CUDA, fixed shapes).
        intra_op_threads: torch CPU thread policy: `"auto"`, an int or `None`
            (see the module docstring).
        auto_steps: timed rounds per candidate for `dispatch="auto"` (more
            rounds make the choice steadier).
        *args, **kwargs: as for `keras.Model`.

    Example:

    ```python
    inputs = keras.Input((32,))
    towers = [DetachBlock(keras.layers.Dense(16, "relu"), head=keras.layers.Dense(1),
                          loss=keras.losses.BinaryCrossentropy(from_logits=True),
                          name=f"tower_{i}")(inputs) for i in range(2)]
    outputs = keras.layers.Dense(1, "sigmoid")(keras.layers.Concatenate()(towers))
    model = EraseModel(inputs, outputs, dispatch="threaded")
    model.compile("adam", "binary_crossentropy")
    history = model.fit(x, y)  # history keys: loss, tower_0_loss, tower_1_loss
    ```
    """

    def __new__(cls, *args, **kwargs):
        # `EraseModel(inputs, outputs)` builds a `FunctionalEraseModel`. (Keras's own
        # route for Functional subclasses rewrites the class's bases in place,
        # which would break subclassing `EraseModel` afterwards.)
        if cls is EraseModel and _functional_arguments(args, kwargs):
            return FunctionalEraseModel.__new__(FunctionalEraseModel, *args, **kwargs)
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        *args,
        dispatch="auto",
        num_streams=4,
        cuda_graphs=False,
        intra_op_threads="auto",
        auto_steps=AUTO_STEPS,
        **kwargs,
    ):
        if _functional_arguments(args, kwargs) and not isinstance(self, Functional):
            raise TypeError(
                f"{type(self).__name__} is called with inputs/outputs: a Functional subclass "
                "must inherit from keras_erase.model.FunctionalEraseModel."
            )
        super().__init__(*args, **kwargs)
        if dispatch not in DISPATCH_MODES:
            raise ValueError(
                f"EraseModel: `dispatch` must be one of {DISPATCH_MODES}. "
                f"Received: dispatch={dispatch!r}"
            )
        if int(num_streams) < 1:
            raise ValueError(
                f"EraseModel: `num_streams` must be >= 1. Received: num_streams={num_streams}"
            )
        if not (intra_op_threads in (None, "auto") or int(intra_op_threads) >= 1):
            raise ValueError(
                "EraseModel: `intra_op_threads` must be 'auto', None or an int >= 1. "
                f"Received: intra_op_threads={intra_op_threads!r}"
            )
        state = self.__dict__  # plain attributes, outside Keras/torch tracking
        state["dispatch"] = dispatch
        state["num_streams"] = int(num_streams)
        state["cuda_graphs"] = bool(cuda_graphs)
        state["intra_op_threads"] = intra_op_threads
        state["auto_steps"] = int(auto_steps)
        # The schedule in use: always "standard" on JAX and TensorFlow.
        state["dispatch_choice"] = (
            "standard" if not _is_torch() else (None if dispatch == "auto" else dispatch)
        )
        state["auto_timings"] = {}
        state["_erase_trackers"] = {}
        state["_dispatchers"] = {}
        state["_auto"] = None
        state["_trace"] = None
        state["_grad_sync"] = None  # keras_erase.distributed.GradientSync under a process group
        state["_needs_broadcast"] = True
        if _is_torch() and (dispatch == "streams" or cuda_graphs):
            from keras_erase.dispatch import require_cuda

            require_cuda("dispatch='streams'" if dispatch == "streams" else "cuda_graphs=True")
        if self.built:
            self._ensure_trackers()

    # -- blocks, targets and local losses (all backends) ----------------------

    def detach_blocks(self):
        """Every `DetachBlock` of the model (nested ones included), in layer order."""
        return [
            layer
            for layer in self._flatten_layers(include_self=False, recursive=True)
            if isinstance(layer, DetachBlock)
        ]

    def _ensure_trackers(self):
        trackers = self._erase_trackers
        for block in self.detach_blocks():
            if block.has_local_loss and block.name not in trackers:
                trackers[block.name] = keras.metrics.Mean(name=f"{block.name}_loss")
        return list(trackers.values())

    @property
    def metrics(self):
        metrics = super().metrics
        if "_erase_trackers" not in self.__dict__:
            return metrics
        trackers = [t for t in self._ensure_trackers() if t not in metrics]
        head = 1 if metrics and metrics[0] is getattr(self, "_loss_tracker", None) else 0
        return metrics[:head] + trackers + metrics[head:]

    def _output_index(self, name):
        names = list(getattr(self, "output_names", None) or [])
        if name not in names:
            raise ValueError(
                f"DetachBlock target {name!r} is not an output of the model; outputs: {names}"
            )
        return names.index(name)

    def _select_target(self, block, y, sample_weight):
        """The target (and sample weight) the block's local loss compares with."""
        target = block.target
        if y is None:
            raise ValueError(
                f"DetachBlock {block.name!r} has a local loss but the model received no target."
            )

        def pick(structure):
            if isinstance(structure, dict):
                if target is None:
                    if len(structure) != 1:
                        raise ValueError(
                            f"DetachBlock {block.name!r}: the model has several targets "
                            f"{sorted(structure)}; pass `target=` to choose one."
                        )
                    return next(iter(structure.values()))
                if isinstance(target, str):
                    return structure[target]
                names = list(getattr(self, "output_names", None) or structure)
                return structure[names[target]]
            if isinstance(structure, (list, tuple)):
                if target is None:
                    if len(structure) != 1:
                        raise ValueError(
                            f"DetachBlock {block.name!r}: the model has {len(structure)} "
                            "targets; pass `target=` (an output name or index) to choose one."
                        )
                    return structure[0]
                index = target if isinstance(target, int) else self._output_index(target)
                return structure[index]
            if target not in (None, 0) and not (
                isinstance(target, str) and self._output_index(target) == 0
            ):
                raise ValueError(
                    f"DetachBlock {block.name!r}: target={target!r} but the model has one target."
                )
            return structure

        y_true = pick(y)
        weight = None
        if sample_weight is not None:
            same = isinstance(sample_weight, (dict, list, tuple)) == isinstance(
                y, (dict, list, tuple)
            )
            if same:
                weight = pick(sample_weight)
            elif not isinstance(sample_weight, (dict, list, tuple)):
                weight = sample_weight
        return y_true, weight

    def _clear_pending(self):
        for block in self.detach_blocks():
            block._pending_predictions.clear()

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """Main (compiled) loss plus every block's pending local loss; logs each local loss."""
        total = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        # Local losses exist in training only: evaluate/validation logs leave them out.
        self.__dict__["_local_losses_active"] = bool(training)
        trackers = self._erase_trackers
        batch = None
        for block in self.detach_blocks():
            pending = block.pop_pending_predictions()
            if not pending:
                continue
            y_true, weight = self._select_target(block, y, sample_weight)
            if batch is None:
                batch = ops.shape(tree.flatten(y_true)[0])[0]
            for entry in pending:
                if isinstance(entry, LocalLossValue):
                    value = entry.value
                else:
                    value = block.local_loss(y_true, entry, weight)
                tracker = trackers.get(block.name)
                if tracker is None:
                    tracker = self._ensure_trackers() and trackers[block.name]
                tracker.update_state(ops.stop_gradient(value), sample_weight=batch)
                total = ops.add(total, ops.cast(value, total.dtype))
        return total

    def get_metrics_result(self):
        result = super().get_metrics_result()
        if not self.__dict__.get("_local_losses_active", True):
            for tracker in self._erase_trackers.values():
                result.pop(tracker.name, None)
        return result

    def __call__(self, *args, **kwargs):
        self._clear_pending()
        return super().__call__(*args, **kwargs)

    def stateless_call(self, *args, **kwargs):
        self._clear_pending()
        return super().stateless_call(*args, **kwargs)

    # -- configuration ------------------------------------------------------------

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "dispatch": self.dispatch,
                "num_streams": self.num_streams,
                "cuda_graphs": self.cuda_graphs,
                "intra_op_threads": self.intra_op_threads,
                "auto_steps": self.auto_steps,
            }
        )
        return config

    # -- tracing (torch) ------------------------------------------------------------

    def start_trace(self):
        """Starts recording forward/backward intervals of the ERASE step; returns the event list.

        Each event is a dict with `block`, `phase` (`"forward"`, `"submit"`,
        `"backward"`), `start`, `end` (`time.perf_counter()`) and `thread`.
        """
        self.__dict__["_trace"] = []
        for dispatcher in self._dispatchers.values():
            dispatcher.trace = self._trace
        return self._trace

    def stop_trace(self):
        """Stops recording and returns the recorded events."""
        events = self._trace
        self.__dict__["_trace"] = None
        for dispatcher in self._dispatchers.values():
            dispatcher.trace = None
        return events

    # -- torch ERASE train step -----------------------------------------------------

    def fit(self, *args, **kwargs):
        if not _is_torch():
            return super().fit(*args, **kwargs)
        import torch

        threads = torch.get_num_threads()
        self.__dict__["_needs_broadcast"] = True  # rank 0's weights at the start of training
        try:
            return super().fit(*args, **kwargs)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def _cuda(self):
        import torch

        return torch.cuda.is_available()

    def _threads_for(self, mode):
        from keras_erase import dispatch as dispatch_lib

        policy = self.intra_op_threads
        if policy is None:
            return None
        if policy == "auto":
            if mode == "threaded" and not self._cuda():
                return dispatch_lib.threads_for_worker()
            return None
        return int(policy)

    def _auto_candidates(self):
        import torch

        from keras_erase import dispatch as dispatch_lib

        if self._cuda():
            return [("standard", None), ("streams", None)]
        default = torch.get_num_threads()
        # "threaded" only at most half the cores: a worker thread whose OpenMP team is
        # as wide as the machine slowed every later 2-thread step of the process about 2x
        # (measured on 2 cores), so even trying it would cost the standard step.
        return [("standard", default), ("threaded", min(default, dispatch_lib.threads_for_worker()))]

    def _next_schedule(self):
        """(mode, threads) for this step; with "auto", the trial schedule or the choice."""
        if self.dispatch != "auto":
            return self.dispatch, self._threads_for(self.dispatch)
        if self.dispatch_choice is not None:
            return self._auto["choice"]
        if self._auto is None:
            self.__dict__["_auto"] = {
                "candidates": self._auto_candidates(),
                "step": 0,
                "times": {},
                "choice": None,
            }
        auto = self._auto
        candidates = auto["candidates"]
        return candidates[auto["step"] % len(candidates)]

    def _observe(self, schedule, seconds):
        auto = self._auto
        if auto is None or self.dispatch_choice is not None:
            return
        candidates = auto["candidates"]
        if auto["step"] >= len(candidates):  # the first round is warm-up
            auto["times"].setdefault(schedule, []).append(seconds)
        auto["step"] += 1
        if auto["step"] >= len(candidates) * (1 + max(1, self.auto_steps)):
            self._choose(candidates, auto)

    def _choose(self, candidates, auto):
        """Applies the `"auto"` rule (module docstring) to the timed rounds."""
        stats = [
            (float(np.median(auto["times"][c])), float(np.percentile(auto["times"][c], 90)))
            for c in candidates
        ]
        sync = self._gradient_sync()
        if sync is not None:  # every rank must choose the same schedule
            from keras_erase.distributed import mean_over_ranks

            flat = mean_over_ranks([value for pair in stats for value in pair])
            stats = list(zip(flat[0::2], flat[1::2]))
        timings = dict(zip(candidates, stats))
        base_median, base_p90 = timings[candidates[0]]
        limit = 1.0 - AUTO_MARGIN
        faster = [
            c for c in candidates[1:]
            if timings[c][0] <= base_median * limit and timings[c][1] <= base_p90 * limit
        ]
        choice = min(faster, key=lambda c: timings[c][1]) if faster else candidates[0]
        auto["choice"] = choice
        self.__dict__["dispatch_choice"] = choice[0]
        self.__dict__["auto_timings"] = {
            f"{mode}@{threads}": {"median_s": timings[(mode, threads)][0],
                                  "p90_s": timings[(mode, threads)][1]}
            for mode, threads in candidates
        }
        LOGGER.info(
            "keras_erase: dispatch='auto' chose %r with intra_op_threads=%s "
            "(step seconds per candidate: %s)",
            choice[0],
            choice[1],
            self.auto_timings,
        )

    def _dispatcher(self, mode):
        from keras_erase import dispatch as dispatch_lib

        dispatcher = self._dispatchers.get(mode)
        if dispatcher is None:
            dispatcher = dispatch_lib.make_dispatcher(
                mode, num_streams=self.num_streams, cuda_graphs=self.cuda_graphs
            )
            self._dispatchers[mode] = dispatcher
        dispatcher.trace = self._trace
        return dispatcher

    def _gradient_sync(self):
        """The `GradientSync` when a multi-rank torch.distributed group is initialized."""
        from keras_erase import distributed

        if not distributed.active():
            return None
        if self._grad_sync is None:
            self.__dict__["_grad_sync"] = distributed.GradientSync()
        return self._grad_sync

    def train_step(self, *args, **kwargs):
        if not _is_torch():  # JAX (state, data) and TensorFlow (data): the stock step
            return super().train_step(*args, **kwargs)
        import torch

        (data,) = args

        from keras_erase import dispatch as dispatch_lib

        schedule = self._next_schedule()
        mode, threads = schedule
        dispatch_lib.set_intra_op_threads(threads)
        timing = self.dispatch_choice is None and self._auto is not None
        if timing and self._cuda():
            torch.cuda.synchronize()
        start = time.perf_counter()
        sync = self._gradient_sync()
        if sync is not None and self._needs_broadcast:
            sync.broadcast_parameters(self)
            self.__dict__["_needs_broadcast"] = False
        if mode == "standard" and sync is None:
            logs = super().train_step(data)
        else:  # the standard step under a process group: no dispatcher, one backward
            dispatcher = None if mode == "standard" else self._dispatcher(mode)
            logs = self._erase_step(data, dispatcher, sync)
        if timing:
            if self._cuda():
                torch.cuda.synchronize()
            self._observe(schedule, time.perf_counter() - start)
        return logs

    def _erase_step(self, data, dispatcher, sync=None):
        """One ERASE step: zero grads, forward with early block backwards, main backward, update.

        Without a dispatcher, the standard schedule (one backward). With a
        `GradientSync`, each block's gradients are all-reduced right after its
        backward, the rest after the final backward, all waited before the update.
        """
        import torch
        from keras.src.trainers.data_adapters import data_adapter_utils

        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        # Zero BEFORE the forward pass: blocks write their gradients during it.
        self.zero_grad(set_to_none=True)
        optimizer = self.optimizer
        scale = optimizer.scale_loss if optimizer is not None else (lambda loss: loss)
        handler = None if dispatcher is None else _EraseStep(self, dispatcher, y, sample_weight, scale)
        if dispatcher is not None:
            dispatcher.after_backward = None if sync is None else sync.block_done
        if sync is not None:
            sync.start_step(self)
        try:
            with step_handler(handler) if handler is not None else contextlib.nullcontext():
                if self._call_has_training_arg:
                    y_pred = self(x, training=True)
                else:
                    y_pred = self(x)
            # Main loss + the blocks' local losses as constants (already back-propagated).
            loss = self._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            self._loss_tracker.update_state(
                loss, sample_weight=next(i for i in tree.flatten(x) if i is not None).shape[0]
            )
            scaled = scale(loss)
            if handler is not None and handler.shares_graph:
                dispatcher.finish()  # blocks reach upstream layers: finish them first
            if scaled.requires_grad:
                scaled.backward()
            if dispatcher is not None:
                dispatcher.finish()
            if sync is not None:  # after the worker drained: one thread issues at a time
                sync.reduce_rest()
                sync.finish()
        except BaseException:
            if dispatcher is not None:
                dispatcher.abort()
            if sync is not None:
                sync.abort()
            raise
        trainable_weights = self.trainable_weights[:]
        if trainable_weights:
            gradients = [v.value.grad for v in trainable_weights]
            with torch.no_grad():
                optimizer.apply(gradients, trainable_weights)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


@keras.saving.register_keras_serializable(package="keras_erase")
class FunctionalEraseModel(EraseModel, Functional):
    """The Functional form of `EraseModel`, built by `EraseModel(inputs, outputs, ...)`."""

"""The torch train step of `EraseModel`: its `Schedule`, early block backwards, distributed sync.

`erase_step` follows Keras's torch `train_step` (zero the gradients, forward,
`compute_loss`, loss tracker, backward, `optimizer.apply`, `compute_metrics`)
and owns it because the blocks' backwards start inside the forward: each
block is handed to the `ScheduleRun` (`BlockRunner`), and its
`final_backward` runs the main loss's backward, joins the blocks, then runs
the shared upstream's one backward (`keras_erase.torch.handoff`).
"""

import contextlib
import dataclasses
import logging
import time
import warnings

import keras
import torch
from keras import tree

from keras_erase import _keras_private
from keras_erase.block_weights import block_owned_weights
from keras_erase.block_weights import shared_weights
from keras_erase.block_weights import weights_outside_blocks
from keras_erase.config import name_of
from keras_erase.config import schedule_of
from keras_erase.step_protocol import step_handler
from keras_erase.local_losses import LocalLossValue
from keras_erase.local_losses import batch_weight
from keras_erase.targets import select_target
from keras_erase.torch.auto import CPU_EXPLANATION
from keras_erase.torch.auto import explain
from keras_erase.torch.auto import explain_fixed
from keras_erase.torch.auto import new_selector
from keras_erase.torch import distributed
from keras_erase.torch.cuda_graphs.capture import require_capture
from keras_erase.torch.schedules import make_schedule_run
from keras_erase.torch.schedules.placements import require_streams
from keras_erase.torch.tensors import to_device
from keras_erase.torch.threads import main_thread_count
from keras_erase.torch.threads import restored_intra_op_threads
from keras_erase.torch.threads import set_intra_op_threads
from keras_erase.torch.threads import worker_thread_count

__all__ = [
    "close_schedule_runs", "dispatch_choice", "erase_step", "explanation", "train_step",
    "training_scope",
]

LOGGER = logging.getLogger("keras_erase")


def cuda_available():
    return torch.cuda.is_available()


class BlockRunner:
    """The step handler (`keras_erase.step_protocol`) of one ERASE step: hands each block to the `ScheduleRun`."""

    def __init__(self, model, schedule_run, y, sample_weight, scale_loss):
        self.model = model
        self.schedule_run = schedule_run
        self.y = y
        self.sample_weight = sample_weight
        self.scale_loss = scale_loss

    def run_block(self, block, inputs):
        y_true, sample_weight = select_target(
            block, self.y, self.sample_weight, getattr(self.model, "output_names", None)
        )
        outputs, loss = self.schedule_run.run_block(
            block, inputs, y_true, sample_weight, self.scale_loss
        )
        block.add_pending(LocalLossValue(loss))
        return outputs


def auto_on_cpu(config):
    """Whether `"auto"` is the standard step without measuring (torch sees no CUDA)."""
    return config.dispatch == "auto" and not cuda_available()


def dispatch_choice(runtime):
    return "standard" if auto_on_cpu(runtime.config) else runtime.dispatch_choice


def explanation(runtime):
    if runtime.config.dispatch != "auto":
        return explain_fixed(runtime, cuda_available())
    if auto_on_cpu(runtime.config):
        return CPU_EXPLANATION
    if runtime.selector is None:
        return "dispatch='auto' on CUDA has not measured yet: it measures at the first training steps"
    return explain(runtime)


def gradient_sync(runtime):
    if not distributed.active():
        return None
    if runtime.grad_sync is None:
        runtime.grad_sync = distributed.GradientSync()
    return runtime.grad_sync


def next_schedule(runtime):
    """This step's `Schedule` (`None`: the standard step); `"auto"` asks its selector."""
    config = runtime.config
    if config.dispatch != "auto":
        return config.schedule(cuda_available())
    if auto_on_cpu(config):
        return None
    if runtime.selector is None:
        sync = gradient_sync(runtime)
        combine = None
        if sync is not None:  # every rank must choose the same schedule
            combine = distributed.mean_over_ranks
        runtime.selector = new_selector(config, combine=combine)
    return schedule_of(runtime.selector.next_schedule())


def order_shared_gradients(schedule_run, model, blocks):
    """Tells the placement which weights' `.grad` several streams write (blocks', the main path's)."""
    owned = block_owned_weights(model, blocks)
    outside = weights_outside_blocks(model)
    shared = {}
    for block in blocks:
        mine = {id(w) for w in owned.get(id(block), ())}
        shared[id(block)] = [id(w) for w in block.trainable_weights if id(w) not in mine]
    on_main = {key for ids in shared.values() for key in ids if key in outside}
    schedule_run.placement.share(shared, on_main)


def schedule_run_for(runtime, schedule, model):
    """The runtime's `ScheduleRun` for `schedule`, built at first use (shared-weight blocks: no graphs)."""
    schedule_run = runtime.schedule_runs.get(schedule)
    if schedule_run is None:
        config = runtime.config
        schedule_run = make_schedule_run(
            schedule,
            num_streams=config.num_streams,
            worker_threads=worker_thread_count(config.intra_op_threads, cuda_available()),
        )
        blocks = model.detach_blocks()
        order_shared_gradients(schedule_run, model, blocks)
        if schedule_run.graphs is not None:
            shared = shared_weights(model, blocks)
            for block in blocks:
                if id(block) in shared:
                    schedule_run.graphs.refuse(block, f"its weights {shared[id(block)]} are also "
                                                    "used outside it (another block or the main "
                                                    "path), whose autograd graphs hold them")
        runtime.schedule_runs[schedule] = schedule_run
    schedule_run.trace = runtime.trace
    return schedule_run


def train_step(model, runtime, data, standard_step):
    """Runs one torch training step of `model`; `standard_step(data)` is Keras's own."""
    config = runtime.config
    if config.needs_cuda:  # checked here, not at construction: loading works anywhere
        fixed = config.schedule(cuda_available())
        if fixed is not None and fixed.placement == "block_streams":
            require_streams(f"dispatch={config.dispatch!r} (a CUDA stream per block)")
        if config.cuda_graphs:  # CUDA, or the CPU stand-in capture (tests, dry runs)
            require_capture()
    schedule = next_schedule(runtime)
    if config.dispatch == "early" and runtime.dispatch_choice == "early":  # the resolved one
        runtime.dispatch_choice = dataclasses.replace(schedule, graphs=False).name
    cuda = cuda_available()
    set_intra_op_threads(main_thread_count(schedule, config.intra_op_threads, cuda))
    selector = runtime.selector
    timing = selector is not None and not selector.done
    if timing and cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    sync = gradient_sync(runtime)
    if sync is not None and runtime.needs_broadcast:
        sync.broadcast_parameters(model)
        runtime.needs_broadcast = False
    if schedule is None and sync is None:
        logs = standard_step(data)
    else:  # the standard step under a process group: no `ScheduleRun`, one backward
        schedule_run = None if schedule is None else schedule_run_for(runtime, schedule, model)
        logs = erase_step(model, runtime, data, schedule_run, sync)
    if timing:
        if cuda:
            torch.cuda.synchronize()
        selector.record(name_of(schedule), time.perf_counter() - start)
        if selector.done:
            runtime.dispatch_choice = selector.choice
            close_schedule_runs(runtime, keep=schedule_of(selector.choice))  # the trials' workers
            _log_choice(runtime)
        else:
            release_measured_graphs(runtime)
    return logs


def release_measured_graphs(runtime):
    """Closes the run of each graphed candidate `"auto"` has measured: its graphs and pools go (kept,
    it captures again), so one candidate holds graph pools at a time."""
    for schedule in [s for s in runtime.schedule_runs if s.graphs]:
        if runtime.selector.measured(name_of(schedule)):
            runtime.schedule_runs.pop(schedule).close()


@contextlib.contextmanager
def training_scope(runtime, whole_fit):
    """Wraps one `fit` (`whole_fit=True`) or `train_on_batch` call on torch.

    Restores the thread count on exit; for a whole `fit`, broadcasts rank 0's
    weights at its first step and closes every `ScheduleRun` at its end.
    """
    if whole_fit:
        runtime.needs_broadcast = True  # rank 0's weights at the start of training
    try:
        with restored_intra_op_threads():
            yield
    finally:
        if whole_fit:
            close_schedule_runs(runtime)  # training ended: no idle worker thread
            _warn_if_still_measuring(runtime)


def _warn_if_still_measuring(runtime):
    selector = runtime.selector
    if selector is None or selector.done:
        return
    message = "keras_erase: " + explain(runtime, finished_fit=True)
    LOGGER.warning(message)
    warnings.warn(message, UserWarning, stacklevel=4)


def close_schedule_runs(runtime, keep=None):
    for schedule, schedule_run in list(runtime.schedule_runs.items()):
        if schedule != keep:
            schedule_run.close()


def _log_choice(runtime):
    LOGGER.info("keras_erase: %s", explain(runtime))


def erase_step(model, runtime, data, schedule_run, sync=None):
    """One ERASE step; without a `ScheduleRun`, one backward (the standard step under a process group)."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    if schedule_run is not None:  # targets on the weights' device once per step, not per block
        weights = model.trainable_weights
        if weights:
            device = _keras_private.uncast_value(weights[0]).device
            y, sample_weight = to_device((y, sample_weight), device)
    # Zero BEFORE the forward pass: blocks write their gradients during it.
    model.zero_grad(set_to_none=True)
    optimizer = model.optimizer
    scale = optimizer.scale_loss if optimizer is not None else (lambda loss: loss)
    runner = None if schedule_run is None else BlockRunner(model, schedule_run, y, sample_weight, scale)
    if schedule_run is not None:
        schedule_run.after_backward = None if sync is None else sync.block_done
    if sync is not None:
        sync.start_step(model)
    try:
        with step_handler(runner) if runner is not None else contextlib.nullcontext():
            if _keras_private.call_has_training_arg(model):
                y_pred = model(x, training=True)
            else:
                y_pred = model(x)
        # Main loss (without the blocks' own losses) + the blocks' objectives as
        # constants (already back-propagated).
        runtime.blocks_own_losses = runner is not None
        try:
            loss = _keras_private.compute_loss(model, x, y, y_pred, sample_weight, training=True)
        finally:
            runtime.blocks_own_losses = False
        batch = next(i for i in tree.flatten(x) if i is not None).shape[0]
        _keras_private.loss_tracker(model).update_state(  # as Keras, without a host copy
            loss, sample_weight=batch_weight(loss, batch)
        )
        scaled = scale(loss)
        if schedule_run is None:
            if scaled.requires_grad:
                scaled.backward()
        else:  # the main loss's part, then joins the blocks; one backward of the upstream
            # (under a process group the blocks are joined first: their all-reduce
            # must read only the block's part of a weight the main path uses too)
            schedule_run.final_backward(scaled, early_main=sync is None)
        if sync is not None:  # after the worker drained: one thread issues at a time
            sync.reduce_rest()
            sync.finish()
    except BaseException:
        if schedule_run is not None:
            schedule_run.abort()
        if sync is not None:
            sync.abort()
        raise
    trainable_weights = model.trainable_weights[:]
    if trainable_weights:
        gradients = [_keras_private.uncast_value(v).grad for v in trainable_weights]
        with torch.no_grad():
            optimizer.apply(gradients, trainable_weights)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

"""Local losses of `DetachBlock`s in the model's loss: values, logs (one `Mean` per block)."""

import keras
from keras import ops
from keras import tree

from keras_erase import _keras_private
from keras_erase.targets import select_target

__all__ = ["LocalLossTrackers", "LocalLossValue", "add_local_losses", "losses_outside_blocks"]


class LocalLossValue:
    """A block's local loss already computed (and back-propagated) by the torch ERASE step."""

    def __init__(self, value):
        self.value = value


class LocalLossTrackers:
    """One `keras.metrics.Mean` per block with a local loss, logged as `"<block name>_loss"`."""

    def __init__(self):
        self.by_name = {}

    def ensure(self, blocks):
        """Creates the missing trackers; returns every tracker."""
        for block in blocks:
            if block.has_local_loss and block.name not in self.by_name:
                self.by_name[block.name] = keras.metrics.Mean(name=f"{block.name}_loss")
        return list(self.by_name.values())

    def names(self):
        return [tracker.name for tracker in self.by_name.values()]


def add_local_losses(total, blocks, trackers, y, sample_weight, output_names):
    """Adds every block's pending local losses to `total`; logs each in its tracker.

    A pending entry is either a `step_protocol.PendingPrediction` (standard step: the loss is
    computed here, in the same trace as the main loss; the block's own `losses`
    are already in the main loss through `model.losses`) or a `LocalLossValue`
    (torch ERASE step: the block's whole objective, its own `losses` included,
    already computed and back-propagated). Either way a block's log is its
    local loss plus its own `losses`. A block called several times in a step
    (a shared tower) adds one local loss per call to the total, so its log is
    their sum, the objective its gradient is of (one log entry per step).
    """
    batch = None
    for block in blocks:
        pending = block._pop_pending_predictions()
        if not pending:
            continue
        y_true, weight = select_target(block, y, sample_weight, output_names)
        if batch is None:
            batch = ops.shape(tree.flatten(y_true)[0])[0]
        tracker = trackers.by_name.get(block.name)
        if tracker is None:
            trackers.ensure([block])
            tracker = trackers.by_name[block.name]
        step_log = None  # a block called twice: the sum of its calls' objectives
        for entry in pending:
            if isinstance(entry, LocalLossValue):
                value = logged = entry.value
            else:
                value = logged = block.local_loss(y_true, entry.prediction, weight)
                if entry.own_losses is not None:
                    logged = logged + entry.own_losses
            logged = ops.cast(ops.stop_gradient(logged), "float32")
            step_log = logged if step_log is None else step_log + logged
            total = ops.add(total, ops.cast(value, total.dtype))
        tracker.update_state(step_log, sample_weight=batch)
    return total


def losses_outside_blocks(model, blocks):
    """Returns `model.losses` without those of `blocks` (their early backward owns them).

    The `add_loss` values of every layer not inside one of `blocks`, and the
    regularizers of every trainable weight none of `blocks` owns: what the
    main loss back-propagates when the blocks' objectives were back-propagated
    early (torch ERASE step, outside any stateless scope).
    """
    inside = {
        id(layer) for block in blocks for layer in _keras_private.sublayers(block, True)
    }
    owned = {id(weight) for block in blocks for weight in block.trainable_weights}
    losses = list(_keras_private.own_added_losses(model))
    for layer in _keras_private.sublayers(model):
        if id(layer) not in inside:
            losses.extend(_keras_private.own_added_losses(layer))
    for weight in model.trainable_weights:
        if weight.regularizer is not None and id(weight) not in owned:
            losses.append(weight.regularizer(weight))
    return losses

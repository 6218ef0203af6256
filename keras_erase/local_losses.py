"""Local losses of `DetachBlock`s in the model's loss and logs (one `Mean` per block), without host copies.

A Python number made into a tensor is a host-to-device copy that syncs on
CUDA: the logs make none (docs/erase.md, "No host sync per step").
"""

import keras
from keras import ops
from keras import tree

from keras_erase import _keras_private
from keras_erase.targets import select_target

__all__ = [
    "LocalLossMean", "LocalLossTrackers", "LocalLossValue", "add_local_losses", "batch_weight",
    "losses_outside_blocks",
]


def batch_weight(value, batch):
    """`batch` as a `Mean` weight for the scalar `value`, made on `value`'s device."""
    if isinstance(batch, int) and not isinstance(batch, bool):
        return ops.ones_like(value) * batch
    return ops.cast(batch, value.dtype)


class LocalLossMean(keras.metrics.Mean):
    """A block's logged local loss: a `keras.metrics.Mean` reset with device zeros, not the Python `0`."""

    def reset_state(self):
        for variable in self.variables:
            variable.assign(ops.zeros(variable.shape, variable.dtype))


class LocalLossValue:
    """A block's local objective already computed and back-propagated by the torch ERASE step."""

    def __init__(self, value):
        self.value = value


class LocalLossTrackers:
    """One `LocalLossMean` per block with a local loss, logged as `"<block name>_loss"`."""

    def __init__(self):
        self.by_name = {}

    def ensure(self, blocks):
        for block in blocks:
            if block.has_local_loss and block.name not in self.by_name:
                self.by_name[block.name] = LocalLossMean(name=f"{block.name}_loss")
        return list(self.by_name.values())

    def names(self):
        return [tracker.name for tracker in self.by_name.values()]


def add_local_losses(total, blocks, trackers, y, sample_weight, output_names):
    """Adds every block's pending local losses to `total`; logs each block's.

    A `PendingPrediction` (standard step) is turned into its local loss here;
    a `LocalLossValue` (torch ERASE step) is added as it is. A block's log is
    its local loss plus its own `losses`, summed over its calls in the step.
    """
    batch = None
    for block in blocks:
        pending = block.pop_pending()
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
        tracker.update_state(step_log, sample_weight=batch_weight(step_log, batch))
    return total


def losses_outside_blocks(model, blocks):
    """`model.losses` without those of `blocks`, whose early backward owns them (torch ERASE step)."""
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

"""Local losses of `DetachBlock`s in the model's loss: values, logs (one `Mean` per block)."""

import keras
from keras import ops
from keras import tree

from keras_erase.targets import select_target


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
    """`total` plus every block's pending local losses; logs each in its tracker.

    A pending entry is either the head's prediction (standard step: the loss is
    computed here, in the same trace as the main loss) or a `LocalLossValue`
    (torch ERASE step: already computed and back-propagated).
    """
    batch = None
    for block in blocks:
        pending = block.pop_pending_predictions()
        if not pending:
            continue
        y_true, weight = select_target(block, y, sample_weight, output_names)
        if batch is None:
            batch = ops.shape(tree.flatten(y_true)[0])[0]
        tracker = trackers.by_name.get(block.name)
        if tracker is None:
            trackers.ensure([block])
            tracker = trackers.by_name[block.name]
        for entry in pending:
            if isinstance(entry, LocalLossValue):
                value = entry.value
            else:
                value = block.local_loss(y_true, entry, weight)
            tracker.update_state(ops.stop_gradient(value), sample_weight=batch)
            total = ops.add(total, ops.cast(value, total.dtype))
    return total

"""Every private Keras use of `keras_erase`, in one place.

Checked against Keras 3.15.1. Each entry says why no public API does the job;
if a Keras release breaks one, only this module changes.
"""

__all__ = [
    "Functional", "call_has_training_arg", "compute_loss", "direct_sublayers", "in_symbolic_scope",
    "keras_mask", "loss_tracker", "own_added_losses", "sublayers", "uncast_value",
]

# `EraseModel(inputs, outputs)` must be a Functional model (Keras's graph of
# layers, `output_names`, serialization of the graph): Keras exposes no public
# Functional class to subclass (`keras.Model(inputs, outputs)` returns one but
# its class is only importable from `keras.src`).
from keras.src.models.functional import Functional

# `DetachBlock` must not compute a local loss during shape inference (Keras
# traces `call` symbolically in `compute_output_spec`); Keras has no public way
# to ask whether a symbolic trace is in progress.
from keras.src.backend.common.symbolic_scope import in_symbolic_scope


def sublayers(layer, include_self=False):
    """Returns every layer nested in `layer` (recursively, deduplicated), in tracking order.

    `Layer._flatten_layers`: the public `layers` attribute exists on models only
    and is not recursive; nested layers held as attributes of a custom layer
    are only reachable this way.
    """
    return layer._flatten_layers(include_self=include_self, recursive=True)


def direct_sublayers(layer):
    """Returns the layers `layer` holds directly (not theirs), deduplicated, in tracking order.

    `Layer._flatten_layers(recursive=False)`: a layer called both inside a
    `DetachBlock` and on the model's main path is a direct sublayer of the
    model as well as of the block; the recursive walk lists it once, so only
    this one tells the two uses apart.
    """
    return layer._flatten_layers(include_self=False, recursive=False)


def own_added_losses(layer):
    """Returns the `add_loss` values of `layer` itself (not of its sublayers) in the current call.

    `Layer._get_own_losses`: the public `losses` property always adds every
    sublayer's losses and every weight regularizer, with no way to split them.
    """
    return layer._get_own_losses()


def call_has_training_arg(model):
    """Returns whether `model.call` accepts `training` (Keras computes it once at construction)."""
    return model._call_has_training_arg


def loss_tracker(model):
    """Returns the `Mean` metric behind the logged `"loss"` (updated by Keras's `train_step`)."""
    return getattr(model, "_loss_tracker", None)


def compute_loss(model, x, y, y_pred, sample_weight, training):
    """Calls `model.compute_loss` with `training` only if the override accepts it (Keras's rule).

    Used by the torch ERASE step exactly as Keras's own torch `train_step` does,
    so a user's `compute_loss` override without `training` keeps working.
    """
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def keras_mask(tensor):
    """Returns the Keras mask attached to `tensor` (or `None`); `get_keras_mask` is not public.

    Used by `DetachBlock.local_loss` to keep Keras's masked-loss semantics.
    """
    from keras.src.backend import get_keras_mask

    return get_keras_mask(tensor)


def uncast_value(variable):
    """Returns the variable's own value (on torch its `nn.Parameter`), never an autocast copy.

    Inside a mixed-precision layer's call (Keras's `AutocastScope`, e.g. a
    `DetachBlock` under `mixed_bfloat16`) `variable.value` is a new float16
    or bfloat16 copy at every read: it has no `.grad`, and a gradient taken
    with respect to it never reaches the variable. Keras has no public way to
    read the variable itself there, so the scope is cleared for the read.
    """
    from keras.src.backend.common.variables import AutocastScope

    with AutocastScope(None):
        return variable.value

"""Every private Keras use of `keras_erase`, each saying why (checked against Keras 3.15.1)."""

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
    """Every layer nested in `layer`, deduplicated (the public `layers`: models only, not recursive)."""
    return layer._flatten_layers(include_self=include_self, recursive=True)


def direct_sublayers(layer):
    """The layers `layer` holds directly: tells a layer used in a block and on the main path."""
    return layer._flatten_layers(include_self=False, recursive=False)


def own_added_losses(layer):
    """The `add_loss` values of `layer` itself (the public `losses` adds sublayers' and penalties)."""
    return layer._get_own_losses()


def call_has_training_arg(model):
    """Whether `model.call` accepts `training` (Keras computes it once, privately)."""
    return model._call_has_training_arg


def loss_tracker(model):
    """The `Mean` behind the logged `"loss"` (no public handle)."""
    return getattr(model, "_loss_tracker", None)


def compute_loss(model, x, y, y_pred, sample_weight, training):
    """`model.compute_loss`, with `training` only where the override takes it (as Keras calls it)."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def keras_mask(tensor):
    """The Keras mask of `tensor` or `None` (`get_keras_mask` is not public)."""
    from keras.src.backend import get_keras_mask

    return get_keras_mask(tensor)


def uncast_value(variable):
    """The variable's own value (torch: its `nn.Parameter`), not a mixed-precision call's autocast copy."""
    from keras.src.backend.common.variables import AutocastScope

    with AutocastScope(None):
        return variable.value

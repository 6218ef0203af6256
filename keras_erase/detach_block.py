"""`DetachBlock`: a sub-architecture with detached input/output and a local objective.

How a block call meets its model's step (pending predictions, the torch step
handler): `keras_erase.step_protocol`.
"""

from __future__ import annotations

import warnings
from typing import Any
from typing import Callable

import keras
from keras import ops
from keras import tree

from keras_erase import _keras_private
from keras_erase.capture_safe import capture_safe_loss
from keras_erase.capture_safe import is_capture_safe
from keras_erase.capture_safe import weight_penalty
from keras_erase.loss_arguments import checked_loss_weight
from keras_erase.loss_arguments import to_loss_object
from keras_erase.step_protocol import PendingPrediction
from keras_erase.step_protocol import claim_weight_penalties
from keras_erase.step_protocol import collector_evaluating
from keras_erase.step_protocol import collector_training
from keras_erase.step_protocol import current_collector
from keras_erase.step_protocol import current_step_handler
from keras_erase.step_protocol import record_inputs

__all__ = ["DetachBlock"]


def _warn_outside_erase_model(block):
    if block.__dict__.get("_warned_outside"):
        return
    block.__dict__["_warned_outside"] = True
    warnings.warn(
        f"DetachBlock {block.name!r} was called in training outside a keras_erase.EraseModel: "
        "its local loss is neither computed nor trained (the block only stops the gradient, "
        "so its layers do not train at all). Build the model with "
        "keras_erase.EraseModel(inputs, outputs) or subclass keras_erase.EraseModel.",
        stacklevel=3,
    )


def _has_symbolic(structure):
    """Whether this is a shape-inference call (KerasTensors or Keras's symbolic scope)."""
    if _keras_private.in_symbolic_scope():
        return True
    return any(keras.backend.is_keras_tensor(t) for t in tree.flatten(structure))


@keras.saving.register_keras_serializable(package="keras_erase")
class DetachBlock(keras.layers.Layer):
    """A detached sub-architecture with its own local objective (ERASE).

    The block calls its layer on a stop-gradient copy of its input and returns
    a stop-gradient copy of the output; its local objective,
    `loss_weight * loss(y_true, head(output))` plus its own `losses`, trains its
    layers. Its backward thus depends on nothing downstream: the torch step of
    `EraseModel` launches it right after the block's forward pass. `predict`
    computes no local loss; `evaluate` logs it as `"val_<name>_loss"`.

    Args:
        layer: the wrapped `keras.layers.Layer` (a nested model works too).
        head: optional layer producing the local prediction from the block's
            output (without one the output itself is compared with the target).
        loss: local loss (string, function or `keras.losses.Loss`). Without a
            loss the block has no local objective (it only detaches).
        loss_weight: multiplier of the local loss: a finite number >= 0. With
            `0` the local loss is computed and logged but gives no gradient.
        detach_input: stop the gradient at the block's input (default). With
            `False` the local loss also trains the layers upstream.
        target: the model target the local loss uses when there are several:
            an output name or an index into `model.output_names`. `None` uses
            the single target.
        name: layer name; the local loss is logged as `"<name>_loss"`.

    Raises:
        TypeError: `layer`, `head`, `loss` or `target` of the wrong type, or
            a `loss_weight` that is not a number.
        ValueError: an unknown `loss`, or a `loss_weight` < 0 or not finite.

    Example:

    ```python
    tower = DetachBlock(
        keras.Sequential([keras.layers.Dense(64, "relu")]),
        head=keras.layers.Dense(1, "sigmoid"),
        loss="binary_crossentropy", loss_weight=0.1, name="tower_0")
    inputs = keras.Input((16,))
    outputs = keras.layers.Dense(1, "sigmoid")(tower(inputs))
    model = keras_erase.EraseModel(inputs, outputs)
    model.compile("adam", "binary_crossentropy")
    model.fit(x, y)  # logs "loss" and "tower_0_loss"
    ```
    """

    def __init__(
        self,
        layer: keras.layers.Layer,
        head: keras.layers.Layer | None = None,
        loss: str | Callable[..., Any] | keras.losses.Loss | None = None,
        loss_weight: float = 1.0,
        detach_input: bool = True,
        target: str | int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(name=name, **kwargs)
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                f"DetachBlock: `layer` must be a keras Layer or Model. Received: layer={layer!r}"
            )
        if head is not None and not isinstance(head, keras.layers.Layer):
            raise TypeError(
                f"DetachBlock: `head` must be a keras Layer or None. Received: head={head!r}"
            )
        if target is not None and not isinstance(target, (str, int)):
            raise TypeError(
                f"DetachBlock: `target` must be an output name, an index or None. "
                f"Received: target={target!r}"
            )
        self.layer = layer
        self.head = head
        self.loss_identifier = loss
        self.loss_fn = to_loss_object(loss)
        self.loss_weight = checked_loss_weight(loss_weight)
        self.detach_input = bool(detach_input)
        self.target = target
        # Pending head predictions of training calls, consumed by
        # EraseModel.compute_loss. Stored outside Keras's attribute tracking.
        self.__dict__["_pending_predictions"] = []
        # The regularized weights whose penalties this call's own losses include
        # (`claim_weight_penalties`: each once per model call); `None`: all.
        self.__dict__["_penalised_weights"] = None

    @property
    def has_local_loss(self) -> bool:
        """Whether the block contributes a local loss in training."""
        return self.loss_fn is not None

    def build(self, input_shape):
        if not self.layer.built:
            self.layer.build(input_shape)
        if self.head is not None and not self.head.built:
            self.head.build(self.layer.compute_output_shape(input_shape))
        self.built = True

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    # -- forward pieces (also used by the torch `ScheduleRun`) -----------

    def forward_layer(self, inputs: Any, training: bool | None = None) -> Any:
        """Calls the wrapped layer on the (optionally detached) inputs; the output is not detached.

        Example:

        >>> block = DetachBlock(keras.layers.Dense(2))
        >>> tuple(block.forward_layer(keras.ops.ones((3, 4))).shape)
        (3, 2)
        """
        if self.detach_input:
            inputs = tree.map_structure(ops.stop_gradient, inputs)
        if training is None:
            return self.layer(inputs)
        return self.layer(inputs, training=training)

    def predict_local(self, outputs: Any) -> Any:
        """The head's prediction (the output itself without a head)."""
        return outputs if self.head is None else self.head(outputs)

    def local_loss(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        """Computes `loss_weight * loss(y_true, y_pred, sample_weight)` as a float32 scalar.

        The value of Keras's `Loss.__call__`; on torch computed without host data
        where it can be (`keras_erase.capture_safe`), so a CUDA Graph can capture it.

        Example:

        >>> import numpy as np
        >>> block = DetachBlock(keras.layers.Dense(1), loss="mse", loss_weight=0.5)
        >>> float(block.local_loss(np.zeros((2, 1)), np.full((2, 1), 2.0)))
        2.0
        """
        if _torch_backend() and is_capture_safe(self.loss_fn, y_pred):
            value = capture_safe_loss(self.loss_fn, y_true, y_pred, sample_weight)
        else:
            value = self.loss_fn(y_true, y_pred, sample_weight=sample_weight)
        value = ops.cast(value, "float32")
        if self.loss_weight == 0:  # logged, not optimised: no gradient path (frozen check)
            value = ops.stop_gradient(value)
        # A Python-scalar product (no host-to-device constant: CUDA Graph friendly).
        return value * self.loss_weight

    @staticmethod
    def detach(outputs: Any) -> Any:
        """Returns `outputs` (any structure of tensors) with the gradient stopped."""
        return tree.map_structure(ops.stop_gradient, outputs)

    def own_losses(self) -> Any:
        """Sums the block's own `losses` into a float32 scalar (`None` when it has none).

        Its layer's and head's weight regularizers (each once per model call,
        `claim_weight_penalties`) and its current call's `add_loss` values.
        """
        losses = []
        for layer in _keras_private.sublayers(self, include_self=True):
            losses.extend(_keras_private.own_added_losses(layer))
        weights = self._penalised_weights
        if weights is None:
            weights = self._regularized_weights()
        for weight in weights:  # in the weight's dtype, as Keras's `Layer.losses` (not autocast)
            losses.append(weight_penalty(weight.regularizer, _keras_private.uncast_value(weight)))
        total = None
        for loss in losses:
            loss = ops.cast(loss, "float32")
            total = loss if total is None else total + loss
        return total

    def _regularized_weights(self):
        weights = {id(w): w for w in self.trainable_weights if w.regularizer is not None}
        return list(weights.values())

    def local_objective(self, y_true: Any, outputs: Any, sample_weight: Any = None) -> Any:
        """Computes what the block's early backward differentiates: local loss plus own `losses`."""
        value = self.local_loss(y_true, self.predict_local(outputs), sample_weight)
        own = self.own_losses()
        return value if own is None else value + own

    def call(self, inputs, training=None):
        record_inputs(self, inputs)
        # Decided once per call: a warm-up or capture inside it reads the same.
        self.__dict__["_penalised_weights"] = claim_weight_penalties(self._regularized_weights())
        if training is None:
            training = collector_training()
        train_local = bool(training) and self.has_local_loss and not _has_symbolic(inputs)
        if train_local:
            handler = current_step_handler()
            if handler is not None:
                return handler.run_block(self, inputs)
        if train_local and current_collector() is None:
            _warn_outside_erase_model(self)  # nothing is kept: no consumer
            train_local = False
        # A test step (evaluate, validation) also logs the local losses.
        keep = train_local or (
            not training
            and self.has_local_loss
            and collector_evaluating()
            and not _has_symbolic(inputs)
        )
        outputs = self.forward_layer(inputs, training=training)
        if keep:
            self.add_pending(PendingPrediction(self.predict_local(outputs), self.own_losses()))
        return self.detach(outputs)

    def add_pending(self, value):
        """Keeps a training call's local-loss input (or value) for `EraseModel.compute_loss`."""
        self._pending_predictions.append(value)

    def pop_pending(self):
        """The values kept since the last pop, in call order; none is kept after."""
        pending = list(self._pending_predictions)
        self._pending_predictions.clear()
        return pending

    def clear_pending(self):
        """Drops the kept values (a step that ends without computing its loss)."""
        self._pending_predictions.clear()

    # -- serialization ---------------------------------------------------------

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "layer": keras.saving.serialize_keras_object(self.layer),
                "head": (
                    None if self.head is None else keras.saving.serialize_keras_object(self.head)
                ),
                "loss": (
                    None
                    if self.loss_identifier is None
                    else keras.saving.serialize_keras_object(self.loss_identifier)
                ),
                "loss_weight": self.loss_weight,
                "detach_input": self.detach_input,
                "target": self.target,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["layer"] = keras.saving.deserialize_keras_object(config["layer"])
        if config.get("head") is not None:
            config["head"] = keras.saving.deserialize_keras_object(config["head"])
        if config.get("loss") is not None:
            config["loss"] = keras.saving.deserialize_keras_object(config["loss"])
        return cls(**config)


def _torch_backend():
    return keras.backend.backend() == "torch"

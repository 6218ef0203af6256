"""`DetachBlock`: a sub-architecture with detached input/output and a local objective.

A `DetachBlock` wraps a layer (or a whole nested model). In the forward pass it
calls the layer on a stop-gradient copy of its input and returns a stop-gradient
copy of the output, so no gradient crosses the block boundary. Instead the block
owns a local objective, `loss_weight * loss(y_true, head(output))`, computed
against the model's target. Its backward pass therefore depends on nothing
downstream and can start as soon as the block's forward pass is done: this is
what the ERASE train step of `keras_erase.EraseModel` exploits on torch.

How the local loss reaches the model (all backends):

- Standard step (JAX, TensorFlow, torch with `dispatch="standard"`): in a
  training call the block keeps its head's prediction in a small pending list;
  `EraseModel.compute_loss` (same trace, same step) consumes it, compares it
  with the model's target and adds it to the main loss.
- ERASE step (torch): the model installs a *step handler* (see `step_handler`)
  before calling itself; a block that finds one hands its whole computation to
  it (`handler.run_block(block, inputs)`), which computes the local loss right
  after the block's forward pass and launches that loss's backward pass.

`predict` and inference calls never compute a local loss; a test step
(`evaluate`, validation) computes and logs it (`val_<block name>_loss`), so
`val_loss` is comparable with `loss`.
"""

import contextlib
import math
import numbers
import threading
import warnings

import keras
import numpy as np
from keras import ops
from keras import tree

from keras_erase import _keras_private

_STATE = threading.local()


def weight_penalty(regularizer, weight):
    """`regularizer(weight)`; Keras's L1, L2 and L1L2 with Python-float factors.

    Same value as Keras's (which casts each factor to a tensor: a tensor made
    from host data at every call, which a CUDA Graph cannot capture). Any other
    regularizer is called as is.

    Example:

    >>> w = keras.Variable([[1.0, -2.0]])
    >>> float(weight_penalty(keras.regularizers.L1L2(l1=0.5, l2=0.25), w))
    2.75
    """
    kind = type(regularizer)
    if kind is keras.regularizers.L1:
        return regularizer.l1 * ops.sum(ops.absolute(weight))
    if kind is keras.regularizers.L2:
        return regularizer.l2 * ops.sum(ops.square(weight))
    if kind is keras.regularizers.L1L2:
        total = None
        if regularizer.l1 != 0.0:
            total = regularizer.l1 * ops.sum(ops.absolute(weight))
        if regularizer.l2 != 0.0:
            term = regularizer.l2 * ops.sum(ops.square(weight))
            total = term if total is None else total + term
        return ops.zeros((), weight.dtype) if total is None else total
    return regularizer(weight)


class PendingPrediction:
    """A training call's head prediction and the block's own losses, kept for `compute_loss`."""

    def __init__(self, prediction, own_losses=None):
        self.prediction = prediction
        self.own_losses = own_losses


def current_step_handler():
    """The ERASE step handler installed on this thread, or `None`."""
    stack = getattr(_STATE, "stack", None)
    return stack[-1] if stack else None


def current_collector():
    """The `EraseModel` whose call is running on this thread (it consumes local losses), or `None`."""
    stack = getattr(_STATE, "collectors", None)
    return stack[-1][0] if stack else None


def _collector_setting(index, default=None):
    stack = getattr(_STATE, "collectors", None)
    return stack[-1][index] if stack else default


@contextlib.contextmanager
def collecting(model, training=None, evaluating=False):
    """Marks `model` (an `EraseModel`) as the consumer of its blocks' local losses during a call.

    `training`: the value a block called with `training=None` uses (`True` in
    a train step, so that a model whose `call` has no `training` argument still
    trains its blocks). `evaluating`: a test step, where blocks also keep their
    head's prediction (inference mode) so validation losses include them.
    """
    stack = getattr(_STATE, "collectors", None)
    if stack is None:
        stack = _STATE.collectors = []
    stack.append((model, training, evaluating))
    try:
        yield model
    finally:
        stack.pop()


@contextlib.contextmanager
def recording_inputs():
    """Records `(block, inputs)` for every `DetachBlock` call in this thread; yields the list.

    Used by `keras_erase.frozen_upstream` to ask which variables each block's
    input depends on.
    """
    previous = getattr(_STATE, "inputs", None)
    _STATE.inputs = records = []
    try:
        yield records
    finally:
        _STATE.inputs = previous


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


@contextlib.contextmanager
def step_handler(handler):
    """Installs `handler` for the training calls of `DetachBlock`s in this thread.

    The handler must implement `run_block(block, inputs) -> outputs`. Used by
    `EraseModel`'s torch train step; user code does not need it.
    """
    stack = getattr(_STATE, "stack", None)
    if stack is None:
        stack = _STATE.stack = []
    stack.append(handler)
    try:
        yield handler
    finally:
        stack.pop()


class _FunctionLoss(keras.losses.Loss):
    """Wraps a plain loss function `fn(y_true, y_pred)` into a `keras.losses.Loss`."""

    def __init__(self, fn, name=None):
        super().__init__(name=name or getattr(fn, "__name__", "loss"))
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, y_pred)


def _to_loss_object(loss):
    if loss is None or isinstance(loss, keras.losses.Loss):
        return loss
    obj = keras.losses.get(loss)
    if obj is None:
        raise ValueError(f"DetachBlock: unknown `loss`. Received: loss={loss!r}")
    if isinstance(obj, keras.losses.Loss):
        return obj
    if callable(obj):
        return _FunctionLoss(obj)
    raise TypeError(
        f"DetachBlock: `loss` must be a string, a callable or a `keras.losses.Loss`. "
        f"Received: loss={loss!r}"
    )


def _checked_loss_weight(loss_weight):
    """`loss_weight` as a float; `TypeError`/`ValueError` naming it unless a finite number >= 0."""
    if isinstance(loss_weight, bool) or not isinstance(loss_weight, numbers.Real):
        raise TypeError(
            "DetachBlock: `loss_weight` must be a number >= 0. "
            f"Received: loss_weight={loss_weight!r} of type {type(loss_weight).__name__}"
        )
    value = float(loss_weight)
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"DetachBlock: `loss_weight` must be a finite number >= 0. "
            f"Received: loss_weight={loss_weight!r}"
        )
    return value


def _has_symbolic(structure):
    """True for shape-inference calls (KerasTensors or Keras's symbolic scope)."""
    if _keras_private.in_symbolic_scope():
        return True
    return any(keras.backend.is_keras_tensor(t) for t in tree.flatten(structure))


@keras.saving.register_keras_serializable(package="keras_erase")
class DetachBlock(keras.layers.Layer):
    """A detached sub-architecture with its own local objective (ERASE).

    Args:
        layer: the wrapped `keras.layers.Layer` (a nested model works too).
        head: optional layer applied to the block's output to produce the
            local prediction (e.g. `keras.layers.Dense(1, "sigmoid")`). Without
            a head the block's output itself is compared with the target.
        loss: local loss (string, function or `keras.losses.Loss`). Without a
            loss the block has no local objective (it only detaches).
        loss_weight: multiplier of the local loss in the model's total loss: a
            finite number >= 0 (`TypeError` / `ValueError` otherwise).
        detach_input: stop the gradient at the block's input (default). With
            `False` the input is not detached, so upstream layers also receive
            the local loss's gradient.
        target: which of the model's targets the local loss uses when the model
            has several: an output name (dict targets or named outputs) or an
            index into `model.output_names` (Keras sorts dict outputs by
            name). `None` uses the single target.
        name: layer name; the local loss is logged as `"<name>_loss"`.

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
        layer,
        head=None,
        loss=None,
        loss_weight=1.0,
        detach_input=True,
        target=None,
        name=None,
        **kwargs,
    ):
        super().__init__(name=name, **kwargs)
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                f"DetachBlock: `layer` must be a keras Layer or Model. Received: {layer!r}"
            )
        if head is not None and not isinstance(head, keras.layers.Layer):
            raise TypeError(
                f"DetachBlock: `head` must be a keras Layer or None. Received: {head!r}"
            )
        if target is not None and not isinstance(target, (str, int)):
            raise TypeError(
                f"DetachBlock: `target` must be an output name, an index or None. "
                f"Received: target={target!r}"
            )
        self.layer = layer
        self.head = head
        self.loss_identifier = loss
        self.loss_fn = _to_loss_object(loss)
        self.loss_weight = _checked_loss_weight(loss_weight)
        self.detach_input = bool(detach_input)
        self.target = target
        # Pending head predictions of training calls, consumed by
        # EraseModel.compute_loss. Stored outside Keras's attribute tracking.
        self.__dict__["_pending_predictions"] = []

    @property
    def has_local_loss(self):
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

    # -- forward pieces (also used by the torch ERASE dispatchers) -----------

    def forward_layer(self, inputs, training=None):
        """The wrapped layer on (optionally) detached inputs; output not detached."""
        if self.detach_input:
            inputs = tree.map_structure(ops.stop_gradient, inputs)
        if training is None:
            return self.layer(inputs)
        return self.layer(inputs, training=training)

    def predict_local(self, outputs):
        """The head's prediction for the local loss (the output itself without head)."""
        return outputs if self.head is None else self.head(outputs)

    def local_loss(self, y_true, y_pred, sample_weight=None):
        """`loss_weight * loss(y_true, y_pred, sample_weight)` as a float32 scalar.

        The same value as Keras's `Loss.__call__`. On torch it is computed
        without any tensor made from host data and without host syncs (so a
        CUDA Graph can capture it, see `keras_erase.torch.cuda_graphs`): the loss's
        per-sample values (`Loss.call`), weighted and reduced with device ops
        and Python constants (`capture_safe_loss`). Masked predictions, losses
        that override `__call__`, and JAX/TensorFlow (which trace host
        constants into their graphs) use `Loss.__call__`.
        """
        if _torch_backend() and _capture_safe(self.loss_fn, y_pred):
            value = capture_safe_loss(self.loss_fn, y_true, y_pred, sample_weight)
        else:
            value = self.loss_fn(y_true, y_pred, sample_weight=sample_weight)
        # A Python-scalar product (no host-to-device constant: CUDA Graph friendly).
        return ops.cast(value, "float32") * self.loss_weight

    @staticmethod
    def detach(outputs):
        """`outputs` (any structure of tensors) with the gradient stopped."""
        return tree.map_structure(ops.stop_gradient, outputs)

    def own_losses(self):
        """The block's own `losses` summed as a float32 scalar, or `None` when it has none.

        These are the weight regularizers of its layer and head and the
        `add_loss` values (e.g. `activity_regularizer`) of its current call.
        They belong to the block's local objective: on torch they are
        back-propagated by the block's early backward, never by the main one.
        """
        losses = []
        for layer in _keras_private.sublayers(self, include_self=True):
            losses.extend(_keras_private.own_added_losses(layer))
        for weight in self.trainable_weights:
            if weight.regularizer is not None:
                losses.append(weight_penalty(weight.regularizer, weight))
        total = None
        for loss in losses:
            loss = ops.cast(loss, "float32")
            total = loss if total is None else total + loss
        return total

    def local_objective(self, y_true, outputs, sample_weight=None):
        """What the block's early backward differentiates: its local loss plus its own `losses`."""
        value = self.local_loss(y_true, self.predict_local(outputs), sample_weight)
        own = self.own_losses()
        return value if own is None else value + own

    def call(self, inputs, training=None):
        records = getattr(_STATE, "inputs", None)
        if records is not None:
            records.append((self, inputs))
        if training is None:
            training = _collector_setting(1)
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
            and _collector_setting(2, False)
            and not _has_symbolic(inputs)
        )
        outputs = self.forward_layer(inputs, training=training)
        if keep:
            self._pending_predictions.append(
                PendingPrediction(self.predict_local(outputs), self.own_losses())
            )
        return self.detach(outputs)

    def pop_pending_predictions(self):
        """Returns and clears the predictions kept by training calls."""
        pending = list(self._pending_predictions)
        self._pending_predictions.clear()
        return pending

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


def _capture_safe(loss_fn, y_pred):
    from keras_erase._keras_private import keras_mask

    overrides_call = type(loss_fn).__call__ is not keras.losses.Loss.__call__
    masked = any(keras_mask(t) is not None for t in tree.flatten(y_pred))
    return not overrides_call and not masked


def _match_rank(values, weight):
    """Squeezes/expands a trailing 1 so `values` and `weight` have the same rank (as Keras)."""
    values_rank, weight_rank = len(values.shape), len(weight.shape)
    if values_rank == weight_rank + 1 and values.shape[-1] == 1:
        if weight_rank == 1:
            weight = ops.expand_dims(weight, -1)
        else:
            values = ops.squeeze(values, -1)
    elif weight_rank == values_rank + 1 and weight.shape[-1] == 1:
        if values_rank == 1:
            values = ops.expand_dims(values, -1)
        else:
            weight = ops.squeeze(weight, -1)
    return values, weight


def capture_safe_loss(loss_fn, y_true, y_pred, sample_weight=None):
    """`loss_fn(y_true, y_pred, sample_weight)` for an unmasked `keras.losses.Loss`, host-data free.

    Computes the per-sample values with `loss_fn.call`, weights them and
    applies `loss_fn.reduction` exactly as `Loss.__call__` does, but divides
    by Python constants (the static element count) instead of a tensor built
    from the shape, and never calls `divide_no_nan` with a Python scalar.

    Example:

    >>> loss = keras.losses.MeanSquaredError()
    >>> y_true, y_pred = np.array([[1.0], [0.0]]), np.array([[0.5], [0.5]])
    >>> float(capture_safe_loss(loss, y_true, y_pred))
    0.25
    """
    dtype = loss_fn.dtype
    y_pred = tree.map_structure(lambda t: ops.cast(t, dtype), y_pred)
    y_true = tree.map_structure(lambda t: ops.cast(t, dtype), y_true)
    values = loss_fn.call(y_true, y_pred)
    if _keras_private.keras_mask(values) is not None:  # a masking loss: Keras's own path
        return loss_fn(y_true, y_pred, sample_weight=sample_weight)
    values = ops.cast(values, dtype)
    weight = None
    if sample_weight is not None:
        weight = ops.cast(sample_weight, values.dtype)
        values, weight = _match_rank(values, weight)
        values = values * weight
    reduction = loss_fn.reduction
    shape = tuple(values.shape)
    if reduction in (None, "none") or shape in ((), (0,)):
        return values
    total = ops.sum(values)
    if reduction not in ("sum_over_batch_size", "mean", "mean_with_sample_weight"):
        return total  # "sum"
    if reduction == "mean_with_sample_weight" and weight is not None:
        divisor = ops.sum(weight)
        nonzero = ops.cast(divisor != 0, total.dtype)
        return total * nonzero / (divisor + (1 - nonzero))  # divide_no_nan
    count = int(np.prod(shape))
    return total / count if count else total * 0

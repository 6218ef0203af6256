"""Every private Keras use of `keras_cutbce`, in one place, with why (checked against Keras 3.15.1).

1. Loss reduction (`keras.src.losses.loss`): Keras's own reduction,
   masking and distribution scaling, so `CutBCELoss` gives Keras's numbers.
2. Masks (`get_keras_mask`): the mask a layer attached to `y_pred`.
3. The model being loaded or trained (call stack): a saved table path is
   bound to the model's variable (or its owning layer) on `load_model`.
4. JAX trainer state (call stack): a metric reads the step's traced `state`,
   not a variable baked into the compiled step.
5. Symbolic builds (`symbolic_scope`): the traced-table check is skipped.
6. The model being trained (call stack): a trainable table `fit` would
   never update is refused; the walk reads code names only.
7. Metric names in the logs (`CompileMetrics.result`'s `name` local): a
   metric prefixes its dict keys with the name Keras logs it under.
8. JAX trainer's optimizer state (call stack): `SampledSoftmaxLoss` draws
   each step's negatives from the step's traced `iterations`.
9. A step that refuses its targets (call stack, `Variable._direct_assign`):
   JAX's `fit`/`evaluate`/`predict` purge the variables' values before the
   first step and reattach them after the epoch, so a step that raises left
   them purged (the next use: "'NoneType' object is not callable"); the values
   the running loop holds are reattached. TensorFlow keeps the failed
   `tf.function` (the next `fit` traces it again: "Creating variables on a
   non-first call"); the model's step functions are dropped (public attributes).
   Why in the step and not before it: no public hook sees a batch earlier.
   Keras builds the loss and metrics on the first batch's shapes and dtypes
   (`_symbolic_build`, before any trace) only on JAX and torch and only while
   something is unbuilt; TensorFlow without a distribution strategy defers
   that build into the first traced step; between `fit`'s call and that
   step Keras calls only callbacks (no batch), and it picks the data adapter
   by the data's type (no registration).
Nothing else in `keras_cutbce` imports `keras.src` or inspects the call stack.
"""

import contextlib
import inspect

import keras
from keras.src.backend.common.masking import get_keras_mask  # noqa: F401  (2.)
from keras.src.backend.common.symbolic_scope import in_symbolic_scope  # noqa: F401  (5.)
from keras.src.losses.loss import apply_mask  # noqa: F401  (1.)
from keras.src.losses.loss import reduce_weighted_values  # noqa: F401  (1.)
from keras.src.losses.loss import scale_loss_for_distribution  # noqa: F401  (1.)
from keras.src.losses.loss import squeeze_or_expand_to_same_rank  # noqa: F401  (1.)
from keras.src.trainers.compile_utils import CompileMetrics  # (7.)

KERAS_VERSION_CHECKED = "3.15.1"
_JAX_STEPS = ("train_step", "test_step", "predict_step")


def _models_on_stack():
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, keras.Model):
                yield frame, owner
            frame = frame.f_back
    finally:
        del frame


def _owning_layer(model, variable):
    if variable.name != "embeddings":
        return variable
    for layer in model._flatten_layers(include_self=False):
        through_layer = getattr(layer, "lora_enabled", False) or isinstance(
            layer, keras.layers.ReversibleEmbedding
        )
        if through_layer and any(weight is variable for weight in layer.weights):
            return layer
    return variable


def find_model_table(path):
    """The table at `path` in the model being loaded, compiled or trained (variable or owning layer), or None."""
    for _, model in _models_on_stack():
        for variable in model.variables:
            if variable.path == path:
                return _owning_layer(model, variable)
    return None


def jax_step_state():
    """`{id(variable): traced value}` of the JAX trainer step running now, or None."""
    for frame in _frames_named(*_JAX_STEPS):
        local = frame.f_locals
        model, state = local.get("self"), local.get("state")
        if not isinstance(model, keras.Model):
            continue
        if not isinstance(state, (tuple, list)) or len(state) < 2:
            continue
        references = list(model.trainable_variables) + list(model.non_trainable_variables)
        values = list(state[0]) + list(state[1])
        if len(references) == len(values):
            return {id(ref): value for ref, value in zip(references, values)}
    return None


def jax_step_iterations():
    """The traced `optimizer.iterations` of the JAX trainer step running now, or None."""
    for frame in _frames_named(*_JAX_STEPS):
        model, state = frame.f_locals.get("self"), frame.f_locals.get("state")
        optimizer = getattr(model, "optimizer", None)
        if not isinstance(model, keras.Model) or optimizer is None:
            continue
        if not isinstance(state, (tuple, list)) or len(state) < 3:
            continue
        references, values = list(optimizer.variables), list(state[2])
        if len(references) != len(values):
            continue
        for reference, value in zip(references, values):
            if reference is optimizer.iterations:
                return value
    return None


def _frames_named(*names):
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name in names:
                yield frame
            frame = frame.f_back
    finally:
        del frame


def training_model():
    """The `keras.Model` whose `train_step` is running now (innermost), or None."""
    for frame in _frames_named("train_step"):
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.Model):
            return owner
    return None


def compiled_metric_name(metric):
    """`(log_name, output_name)` of `metric` while compiled metrics compute it (Keras's de-duplicated name), or None."""
    for frame in _frames_named("result"):
        local = frame.f_locals
        if isinstance(local.get("self"), CompileMetrics) and local.get("m") is metric:
            name = local.get("name")
            output = getattr(local.get("mls"), "output_name", None)
            return (name, output) if isinstance(name, str) else None
    return None


# The state tuple each JAX loop passes its step (keras/src/backend/jax/trainer.py).
_JAX_LOOP_STATE = {
    "fit": ("trainable", "non_trainable", "optimizer", "metrics"),
    "evaluate": ("trainable", "non_trainable", "metrics"),
    "predict": ("trainable", "non_trainable"),
}


def _step_model():
    for frame in _frames_named(*_JAX_STEPS):
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.Model):
            return owner
    return None


def _reattach_jax_state(model):
    for frame, owner in _models_on_stack():
        parts = _JAX_LOOP_STATE.get(frame.f_code.co_name)
        state = frame.f_locals.get("state")
        if owner is not model or parts is None or not isinstance(state, (tuple, list)):
            continue
        groups = {
            "trainable": model.trainable_variables,
            "non_trainable": model.non_trainable_variables,
            "optimizer": getattr(model.optimizer, "variables", []),
            "metrics": model.metrics_variables,
        }
        if len(state) != len(parts):
            return
        for part, values in zip(parts, state):
            for variable, value in zip(groups[part], values):
                if variable._value is None:
                    variable._direct_assign(value)
        return


@contextlib.contextmanager
def usable_after_refusal():
    """Re-raises a `ValueError`/`TypeError` of a train, test or predict step after leaving the model usable (9.)."""
    try:
        yield
    except (ValueError, TypeError):
        model = _step_model()
        backend = keras.backend.backend()
        if model is not None and backend == "jax":
            _reattach_jax_state(model)
        elif model is not None and backend == "tensorflow":
            import tensorflow as tf

            if not tf.executing_eagerly():
                model.train_function = model.test_function = model.predict_function = None
        raise

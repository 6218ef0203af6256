"""Every private Keras use of `keras_cutbce`, in one place, with why.

Checked against Keras 3.15.1. Nothing else in `keras_cutbce` imports
`keras.src` or inspects the call stack.

1. Loss reduction (`keras.src.losses.loss`): `CutBCELoss` must give
   Keras's numbers for every reduction, sample-weight shape and mask, i.e.
   do exactly what `keras.losses.Loss.__call__` does after `call`. Keras
   exposes no public reduction helper, so we call its own
   (`reduce_weighted_values`, `apply_mask`, `squeeze_or_expand_to_same_rank`,
   `scale_loss_for_distribution`) rather than copy them.
2. Masks (`keras.src.backend.common.masking.get_keras_mask`): the Keras mask
   a layer attached to `y_pred`; Keras's own losses and metrics read it with
   this function and there is no public accessor.
3. The model being loaded or trained (call-stack inspection): a saved
   `CutBCELoss` or metric stores its table as a variable path; on
   `keras.saving.load_model` the loss is rebuilt by `compile_from_config`
   before any public hook could hand it the model, so we find the model's
   method on the stack and bind the path to its variable (or to the layer
   that owns it, so a LoRA table stays merged and a `ReversibleEmbedding`
   scores with its own output projection).
4. JAX trainer state (call-stack inspection): Keras's JAX `train_step` /
   `test_step` update metrics inside a `StatelessScope` that maps only the
   metric variables; the model's variables are the step's `state` argument.
   A metric that reads the item table must read that traced state, not the
   variable (whose value would be baked into the compiled step at trace time).
5. Symbolic builds (`keras.src.backend.common.symbolic_scope`): Keras traces
   the compiled loss once with `compute_output_spec` (a JAX `eval_shape`
   inside a `SymbolicScope`) to build it; only shapes matter there, so the
   loss's check that a traced `y_pred` comes with a traced table is skipped.
6. The model being trained (call-stack inspection): a trainable item table
   that is not one of the model's variables is never updated by `fit`
   (silently on torch and TensorFlow). The loss finds the model whose
   `train_step` is running and checks that its table is among the model's
   trainable variables; Keras hands a loss no model. The stack walk reads
   only the code names until it meets `train_step`, and the loss remembers
   a model found to train its table, so later steps skip the check.
7. Metric names in the logs (`keras.src.trainers.compile_utils.CompileMetrics`,
   call-stack inspection): Keras logs two compiled metrics of one name as
   `name` and `name_1`, but flattens a metric's dict result into its own
   keys, so two `TopKRetrieval` with the default name would log the same
   keys. A metric reads the name Keras logs it under (the `name` local of
   `CompileMetrics.result`: de-duplicated, or output-prefixed in a
   multi-output model) to prefix its keys.
"""

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
    """The `keras.Model` instances whose methods are on the call stack, innermost first."""
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
    """The layer of `model` to read for the item table `variable` (an `embeddings` weight).

    A LoRA-enabled layer (whose table merges the LoRA factors) or a
    `ReversibleEmbedding` (whose projection may be `reverse_embeddings`) is
    read through the layer; any other variable is returned as it is.
    """
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
    """The table at variable `path` in the Keras model being loaded, compiled or trained.

    Returns the variable, or the LoRA-enabled layer that owns it (whose
    `embeddings` merge the LoRA factors), or None when no model on the call
    stack has a variable with that path.
    """
    for _, model in _models_on_stack():
        for variable in model.variables:
            if variable.path == path:
                return _owning_layer(model, variable)
    return None


def jax_step_state():
    """`{id(variable): value}` of the JAX trainer step running now, or None.

    Maps the model's trainable and non-trainable variables to the traced
    values of the enclosing `train_step`/`test_step`/`predict_step`'s `state`.
    """
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


def _frames_named(*names):
    """The frames of the call stack running a function called one of `names`, innermost first.

    Reads only each frame's code name; the (costly) locals are left to the
    caller, for the frames that match.
    """
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
    """`(log_name, output_name)` of `metric` while a model's compiled metrics compute it.

    `log_name` is the name Keras logs the metric's result under: its `name`,
    prefixed with `output_name` in a multi-output model, or, for the second
    metric of that name in one model, Keras's de-duplicated `name_1`
    (`weighted_name` in `weighted_metrics`). None outside a compiled model's
    metrics.
    """
    for frame in _frames_named("result"):
        local = frame.f_locals
        if isinstance(local.get("self"), CompileMetrics) and local.get("m") is metric:
            name = local.get("name")
            output = getattr(local.get("mls"), "output_name", None)
            return (name, output) if isinstance(name, str) else None
    return None

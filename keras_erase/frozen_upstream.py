"""Which weights a loss reaches, on every backend, and the frozen-upstream warning.

A trainable layer that feeds the losses only through blocks with
`detach_input=True` never trains; `EraseModel` warns once, at its first train
step (docs/erase.md, "A frozen upstream is never silent"). The check asks each
backend's autodiff without running the step or changing any state.
"""

import logging
import warnings

import keras
from keras import ops
from keras import tree

from keras_erase.runtime import torch_runtime
from keras_erase.step_protocol import recording_inputs

__all__ = [
    "FrozenUpstreamWarning", "frozen_message", "frozen_variables", "reached", "warn_if_frozen",
]

LOGGER = logging.getLogger("keras_erase")


class FrozenUpstreamWarning(UserWarning):
    """Trainable variables of an `EraseModel` get no gradient from any loss."""


def _scalar(structure):
    total = ops.zeros((), "float32")
    for tensor in tree.flatten(structure):
        if "float" in str(getattr(tensor, "dtype", "")):
            total = total + ops.sum(ops.cast(tensor, "float32"))
    return total


def _objectives_fn(model, data, state):
    """`fn(trainable values) -> [total loss, one input scalar per detaching block]`, and those blocks."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    blocks = []

    def fn(values):
        with recording_inputs() as records:
            if state is not None:  # JAX: the trainer's state (model variables may be purged)
                _, non_trainable, optimizer, metrics = state
                loss, _ = model.compute_loss_and_updates(
                    values, non_trainable, metrics, x, y, sample_weight, training=True,
                    optimizer_variables=optimizer,
                )
            else:
                mapping = list(zip(model.trainable_variables, values))
                with keras.StatelessScope(state_mapping=mapping):
                    y_pred = model(x, training=True)
                    loss = model.compute_loss(x, y, y_pred, sample_weight, training=True)
        detaching = [(b, inputs) for b, inputs in records if b.detach_input]
        blocks[:] = [b for b, _ in detaching]
        return [ops.cast(loss, "float32")] + [_scalar(inputs) for _, inputs in detaching]

    return fn, blocks


def reached(fn, values):
    """For `outputs = fn(values)` (Keras ops): `[[output i has a gradient path to value j for j] for i]`.

    Example:

    >>> values = [keras.ops.ones((2,)), keras.ops.ones((2,))]
    >>> reached(lambda v: [ops.sum(v[0] * ops.stop_gradient(v[1]))], values)
    [[True, False]]
    """
    backend = keras.backend.backend()
    if backend == "torch":
        return torch_runtime().tensors.reached(fn, values)
    if backend == "tensorflow":
        return _tf_reached(fn, values)
    if backend == "jax":
        return _jax_reached(fn, values)
    raise NotImplementedError(
        "reached supports the jax, tensorflow and torch backends. "
        f"Received: backend={backend!r}"
    )


def _tf_reached(fn, values):
    import tensorflow as tf

    answers = []

    def probe(*tensors):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(list(tensors))
            outputs = fn(list(tensors))
        for output in outputs:
            grads = tape.gradient(output, list(tensors))
            answers.append([g is not None for g in grads])
        return tf.constant(0.0)

    specs = [tf.TensorSpec(v.shape, v.dtype) for v in values]
    tf.function(probe).get_concrete_function(*specs)  # traced, never run
    return answers


def _jax_reached(fn, values):
    import jax
    from jax.extend import core as jax_core

    def is_zero(literal):
        return isinstance(literal, jax_core.Literal) and not getattr(literal.val, "shape", ()) and (
            float(literal.val) == 0.0
        )

    count = len(jax.eval_shape(lambda v: fn(list(v)), list(values)))  # traced, never run
    answers = []
    for i in range(count):
        closed = jax.make_jaxpr(jax.grad(lambda v, i=i: fn(list(v))[i]))(list(values))
        producer = {id(out): eqn for eqn in closed.jaxpr.eqns for out in eqn.outvars}
        found = []
        for out in closed.jaxpr.outvars:
            if is_zero(out):
                found.append(False)
                continue
            eqn = producer.get(id(out))
            symbolic_zero = (
                eqn is not None
                and eqn.primitive.name == "broadcast_in_dim"
                and is_zero(eqn.invars[0])
            )
            found.append(not symbolic_zero)
        answers.append(found)
    return answers


def frozen_variables(model, data, state=None):
    """The trainable variables no loss reaches: `[(variable, [blocks whose input reads it])]`; `state`: JAX's trainer state."""
    variables = model.trainable_variables
    if not variables:
        return []
    values = list(state[0]) if state is not None else [v.value for v in variables]
    fn, blocks = _objectives_fn(model, data, state)
    answers = reached(fn, values)
    loss_reaches, block_reads = answers[0], answers[1:]
    frozen = []
    for i, variable in enumerate(variables):
        if not loss_reaches[i]:
            readers = [b for b, reads in zip(blocks, block_reads) if reads[i]]
            frozen.append((variable, list(dict.fromkeys(readers))))
    return frozen


def frozen_message(frozen, zero_weight_owners=None):
    """The warning text; `zero_weight_owners`: `{id(variable): block name}` of `loss_weight=0` blocks."""
    zero_weight_owners = zero_weight_owners or {}
    lines = [
        f"EraseModel: {len(frozen)} trainable variable(s) get no gradient from any loss, so "
        "they never train:"
    ]
    fix = []
    for variable, readers in frozen:
        if readers:
            names = ", ".join(repr(b.name) for b in readers)
            lines.append(f"  {variable.path!r}: read only through DetachBlock(s) {names}, "
                         "which stop the gradient at their input (detach_input=True, the default)")
            fix.extend(b.name for b in readers)
        elif id(variable) in zero_weight_owners:
            lines.append(f"  {variable.path!r}: inside DetachBlock "
                         f"{zero_weight_owners[id(variable)]!r}, whose loss_weight=0 gives its "
                         "local loss no gradient (the loss is logged, not optimised)")
        else:
            lines.append(f"  {variable.path!r}: no loss depends on it (unused, or inside a "
                         "DetachBlock without `loss`)")
    fix = list(dict.fromkeys(fix))
    zero = sorted(
        {zero_weight_owners[id(v)] for v, r in frozen if not r and id(v) in zero_weight_owners}
    )
    if zero:
        lines.append(
            "To train them, give " + ", ".join(repr(n) for n in zero)
            + " a loss_weight > 0 (loss_weight=0: the local loss is logged only)."
        )
    if fix:
        lines.append(
            "To train them through the blocks' local losses, build the blocks that read them "
            "with `DetachBlock(..., detach_input=False)`: " + ", ".join(repr(n) for n in fix)
            + ". If they are frozen on purpose, set `trainable = False` on their layer."
        )
    else:
        lines.append("If they are frozen on purpose, set `trainable = False` on their layer.")
    return "\n".join(lines)


def warn_if_frozen(model, data, state=None):
    """Warns about `frozen_variables` and returns them; a model it cannot trace is only logged (debug)."""
    try:
        frozen = frozen_variables(model, data, state)
    except Exception as error:  # noqa: BLE001 - a diagnostic must never break training
        LOGGER.debug("frozen-upstream check skipped: %r", error)
        return []
    if frozen:
        owners = {
            id(weight): block.name
            for block in model.detach_blocks()
            if block.has_local_loss and block.loss_weight == 0
            for weight in block.trainable_weights
        }
        warnings.warn(frozen_message(frozen, owners), FrozenUpstreamWarning, stacklevel=2)
    return frozen

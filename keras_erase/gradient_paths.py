"""Which variables a scalar can differentiate, asked of each backend's autodiff without a backward.

`reached(fn, values)` answers, for every value of `values`, whether each
scalar returned by `fn(values)` has a gradient path to it (a path that no
`stop_gradient` cuts). Nothing is executed beyond what each backend needs to
see the graph:

- torch: `fn` runs eagerly (one forward) and its autograd graph is walked
  from each scalar to the leaves (no backward runs;
  `keras_erase.torch.gradient_paths`).
- TensorFlow: `fn` is traced into a concrete function that is never called;
  `GradientTape.gradient` returns `None` where no path exists.
- JAX: `jax.grad` of each scalar is traced to a jaxpr (never run); a
  variable without a path gets the symbolic zero, materialised as a
  `broadcast_in_dim` of the literal `0.0`.

Example:

>>> import keras
>>> from keras import ops
>>> values = [keras.ops.ones((2,)), keras.ops.ones((2,))]
>>> fn = lambda v: [ops.sum(v[0] * ops.stop_gradient(v[1]))]
>>> reached(fn, values)
[[True, False]]
"""

import keras

from keras_erase.runtime import torch_runtime

__all__ = ["reached"]


def reached(fn, values):
    """Answers, for `outputs = fn(values)`, `[[has path from output i to value j for j] for i]`.

    Args:
        fn: `fn(values) -> list of float scalars`, written with Keras ops.
        values: backend tensors (float) the scalars may depend on.

    Returns:
        One list of booleans per scalar, one boolean per value.
    """
    backend = keras.backend.backend()
    if backend == "torch":
        return torch_runtime().gradient_paths.reached(fn, values)
    if backend == "tensorflow":
        return _tf_reached(fn, values)
    if backend == "jax":
        return _jax_reached(fn, values)
    raise NotImplementedError(
        "gradient_paths.reached supports the jax, tensorflow and torch backends. "
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

"""Inputs and checks shared by the kernel tests of tests/cutbce/.

`mixed_ids` is the id pattern every kernel test uses (valid ids, duplicates,
padding -1, V and V + 5, a row without a valid id); the jaxpr walkers inspect
what the JAX kernels trace (their largest array, the matmuls per tile).
"""

import numpy as np


def mixed_ids(rng, rows, vocab, length):
    """`[rows, length]` int32 ids mixing valid ids, duplicates and padding.

    Example:

    >>> mixed_ids(np.random.default_rng(0), 6, 10, 2).shape
    (6, 2)
    """
    ids = rng.integers(0, vocab, size=(rows, length)).astype("int32")
    if length >= 2:
        ids[0, 1] = ids[0, 0]  # duplicate
        ids[1, :] = ids[1, 0]  # a row of one repeated id
        ids[2 % rows, -1] = -1
    if length >= 1:
        ids[3 % rows, -1] = vocab
        ids[4 % rows, 0] = vocab + 5
        ids[5 % rows, :] = -1  # a row with no valid id
    return ids


def hidden_table_bias(rng, rows, dim, vocab, scale=1.0, dtype="float32"):
    """Random `[rows, dim]` hidden states (times `scale`), `[vocab, dim]` table and `[vocab]` bias."""
    hidden = (scale * rng.normal(size=(rows, dim))).astype(dtype)
    table = rng.normal(size=(vocab, dim)).astype(dtype)
    bias = rng.normal(size=(vocab,)).astype(dtype)
    return hidden, table, bias


def assert_close(got, want, rtol=2e-5, atol=2e-6):
    """`np.testing.assert_allclose` in float64."""
    np.testing.assert_allclose(
        np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol
    )


def _sub_jaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def jaxpr_equations(jaxpr):
    """Every equation of `jaxpr` and of its sub-jaxprs (scan bodies, custom_vjp, pjit)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in _sub_jaxprs(param):
                yield from jaxpr_equations(sub)


def largest_intermediate(fn, *args):
    """Largest number of elements of any value computed in `fn`'s jaxpr (sub-jaxprs too)."""
    import jax

    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return max(
        int(np.prod(getattr(var.aval, "shape", ())))
        for eqn in jaxpr_equations(jaxpr)
        for var in eqn.outvars
    )


def scan_dot_counts(fn, *args):
    """For each `scan` in `fn`'s jaxpr: the number of `dot_general`s in its body."""
    import jax

    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [
        sum(e.primitive.name == "dot_general" for e in jaxpr_equations(eqn.params["jaxpr"].jaxpr))
        for eqn in jaxpr_equations(jaxpr)
        if eqn.primitive.name == "scan"
    ]


def policy_inputs(rng, rows=15, dim=16, vocab=300, length=4):
    """Float32 hidden states, table, bias, ids and row weights for the mixed precision matrix.

    A trained model's logits: the bias around -8 (an item's negatives far
    below 0, whose slopes are what a low precision loses first) and ids only
    in the first third of the items (the rest are never a positive).
    """
    hidden = (2.0 * rng.normal(size=(rows, dim)) / np.sqrt(dim)).astype("float32")
    table = rng.normal(size=(vocab, dim)).astype("float32")
    bias = (rng.normal(size=(vocab,)) - 8.0).astype("float32")
    ids = mixed_ids(rng, rows, vocab // 3, length)
    weights = rng.uniform(0.5, 1.5, size=(rows,)).astype("float32")
    return hidden, table, bias, ids, weights


def dense_under_policy(compute_dtype, family="bce"):
    """The per-row loss a dense Keras model under a policy computes: the dense low-precision reference.

    The logits `h @ E.T + b` in the policy's compute dtype (what a Keras
    `Dense` layer computes: its float32 weights cast to it), then Keras's
    binary cross-entropy (`family="softmax"`: categorical, on `multi_hot / |P|`)
    on them in float32 (a Keras loss's dtype).
    """
    import keras
    from keras import ops

    from keras_cutbce.math.reference import multi_hot

    def loss(h, t, ids, b):
        z = ops.matmul(ops.cast(h, compute_dtype), ops.transpose(ops.cast(t, compute_dtype)))
        z = ops.cast(z + ops.cast(b, compute_dtype), "float32")
        y = multi_hot(ids, t.shape[0])
        if family == "softmax":  # a row without a valid id: y = 0, loss 0
            y = y / ops.maximum(ops.sum(y, axis=-1, keepdims=True), 1.0)
            return keras.losses.categorical_crossentropy(y, z, from_logits=True)
        return keras.losses.binary_crossentropy(y, z, from_logits=True)

    return loss

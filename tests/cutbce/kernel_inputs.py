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

"""JAX: refuse to differentiate a loss whose trainable item table was baked in as a constant.

Under `jax.grad` over `model.stateless_call` without a `keras.StatelessScope`,
`y_pred` is traced while a `keras.Variable` table reads as a concrete value:
the table would get no gradient and stay frozen at trace time. `CutBCELoss`
then wraps `y_pred` in `refuse_differentiation`, an identity whose
derivative raises, so a forward pass (`jax.jit`, `vmap`) still runs.
"""

import jax

DIFFERENTIATED_WITHOUT_TABLE = (
    "CutBCELoss is being differentiated under a JAX transformation (jax.grad over "
    "`model.stateless_call`) while its trainable item table is a keras.Variable with a "
    "concrete value: the table would get no gradient and be frozen at trace time. Call "
    "the loss inside `with keras.StatelessScope(state_mapping=list(zip("
    "model.trainable_variables, trainable_variables)) + list(zip("
    "model.non_trainable_variables, non_trainable_variables))):` (the values being "
    "differentiated), or use `model.stateless_compute_loss`, as Keras's own train step "
    "does. To differentiate w.r.t. the hidden states only, give the loss the table's "
    "value (`CutBCELoss(keras.ops.convert_to_tensor(items.embeddings))`) or freeze it "
    "(`trainable=False`). A forward pass under jax.jit is never refused."
)


def table_would_be_constant(y_pred, table_values):
    """Whether `y_pred` is traced while one of the trainable `table_values` is concrete.

    Example:

    >>> import jax.numpy as jnp
    >>> table = jnp.ones(3)  # a concrete value, as a keras.Variable reads outside a scope
    >>> table_would_be_constant(jnp.ones(2), [table])
    False
    >>> jax.jit(lambda y: jnp.float32(table_would_be_constant(y, [table])))(jnp.ones(2))
    Array(1., dtype=float32)
    """
    return isinstance(y_pred, jax.core.Tracer) and any(
        not isinstance(value, jax.core.Tracer) for value in table_values
    )


def refuse_differentiation(y_pred):
    """Returns `y_pred` unchanged, except that differentiating through it raises.

    An identity with a `jax.custom_jvp` rule that raises: `jax.jit`, `vmap`
    and plain evaluation never call the rule; `jax.grad`, `jax.vjp` and
    `jax.jvp` call it as soon as `y_pred` carries a (non-zero) tangent.

    Example:

    >>> import jax.numpy as jnp
    >>> refuse_differentiation(jnp.ones(2)).tolist()
    [1.0, 1.0]
    """

    @jax.custom_jvp
    def guarded(x):
        return x

    @guarded.defjvp
    def _refuse(primals, tangents):
        raise RuntimeError(DIFFERENTIATED_WITHOUT_TABLE)

    return guarded(y_pred)

"""JAX: refuse to differentiate a loss whose trainable table was baked in as a constant (no silent zero gradient)."""

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
    """Whether `y_pred` is traced while one of the trainable `table_values` is concrete."""
    return isinstance(y_pred, jax.core.Tracer) and any(
        not isinstance(value, jax.core.Tracer) for value in table_values
    )


def refuse_differentiation(y_pred):
    """`y_pred`, whose derivative raises (a `custom_jvp`); `jit`, `vmap` and evaluation run."""

    @jax.custom_jvp
    def guarded(x):
        return x

    @guarded.defjvp
    def _refuse(primals, tangents):
        raise RuntimeError(DIFFERENTIATED_WITHOUT_TABLE)

    return guarded(y_pred)

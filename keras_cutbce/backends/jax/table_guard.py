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


def guard(loss, table_values):
    """`loss`, whose derivative raises (`custom_jvp`) where traced beside a concrete trainable table value."""
    if not isinstance(loss, jax.core.Tracer) or all(
        isinstance(value, jax.core.Tracer) for value in table_values
    ):
        return loss

    @jax.custom_jvp
    def guarded(x):
        return x

    @guarded.defjvp
    def _refuse(primals, tangents):
        raise RuntimeError(DIFFERENTIATED_WITHOUT_TABLE)

    return guarded(loss)

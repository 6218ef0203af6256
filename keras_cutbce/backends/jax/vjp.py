"""The one `jax.custom_vjp` of the chunked, Pallas and sharded implementations (gradients in the inputs' dtypes)."""

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def _cast(grads, hidden, table, bias, scale=None):
    grad_hidden, grad_table, grad_bias = grads
    if scale is not None:
        grad_hidden, grad_table = scale * grad_hidden, scale * grad_table
        grad_bias = None if grad_bias is None else scale * grad_bias
    return (
        grad_hidden.astype(hidden.dtype),
        grad_table.astype(table.dtype),
        None if bias is None else grad_bias.astype(bias.dtype),
    )


def per_row_loss(loss_fn, grads_fn):
    """`f(hidden, table, ids, bias) -> [M]`, saving the inputs; backward: `grads_fn(..., row_scale)`."""

    @jax.custom_vjp
    def loss(hidden, table, ids, bias):
        return loss_fn(hidden, table, ids, bias)

    def forward(hidden, table, ids, bias):
        return loss_fn(hidden, table, ids, bias), (hidden, table, ids, bias)

    def backward(residuals, row_scale):
        hidden, table, ids, bias = residuals
        grads = grads_fn(hidden, table, ids, bias, row_scale.astype(_F32))
        grad_hidden, grad_table, grad_bias = _cast(grads, hidden, table, bias)
        return grad_hidden, grad_table, None, grad_bias

    loss.defvjp(forward, backward)
    return loss


def weighted_sum(loss_fn, loss_and_grads_fn):
    """`f(hidden, table, ids, bias, row_weights) -> scalar`, the gradients at 1 from the forward, scaled backward."""

    @jax.custom_vjp
    def total(hidden, table, ids, bias, row_weights):
        return jnp.vdot(row_weights, loss_fn(hidden, table, ids, bias))

    def forward(hidden, table, ids, bias, row_weights):
        loss_rows, grads = loss_and_grads_fn(hidden, table, ids, bias, row_weights)
        residuals = (grads, hidden, table, bias, jnp.zeros_like(row_weights))
        return jnp.vdot(row_weights, loss_rows), residuals

    def backward(residuals, cotangent):
        grads, hidden, table, bias, zero_weights = residuals
        grad_hidden, grad_table, grad_bias = _cast(
            grads, hidden, table, bias, scale=cotangent.astype(_F32)
        )
        return grad_hidden, grad_table, None, grad_bias, zero_weights

    total.defvjp(forward, backward)
    return total

"""The one `jax.custom_vjp` of the chunked, Pallas and sharded implementations.

`per_row_loss` saves only the inputs and recomputes in its backward pass;
`weighted_sum` computes the loss and the gradients at cotangent 1 in its
forward pass and only scales them backward (the row weights are constants).
Gradients come back scaled and in each input's dtype; `ids` get none.
"""

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
    """`f(hidden, table, ids, bias) -> [M]`, its backward `grads_fn(hidden, table, ids, bias, row_scale)`.

    >>> f = per_row_loss(lambda h, t, i, b: (h @ t.T).sum(1),
    ...                  lambda h, t, i, b, s: (s[:, None] * t.sum(0), s.sum() * h.sum(0)
    ...                                         * jnp.ones_like(t), None))
    >>> jax.grad(lambda h: f(h, jnp.ones((3, 2)), None, None).sum())(jnp.ones((1, 2))).tolist()
    [[3.0, 3.0]]
    """

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
    """`f(hidden, table, ids, bias, row_weights) -> scalar`, the gradients from `loss_and_grads_fn`'s forward."""

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

"""The `jax.custom_vjp` of CutBCE, built once for the chunked, Pallas and sharded kernels.

A kernel supplies how it computes the loss and the gradients; these builders
give it the two differentiable functions every implementation exposes, on
`(hidden [M, D], table [V, D], ids [M, L], bias [V] | None)`:

- `per_row_loss(loss_fn, grads_fn)`: the per-row loss `[M]`, exact for any
  cotangent. Only the inputs are saved; the backward pass calls
  `grads_fn(hidden, table, ids, bias, row_scale)`, the gradients of
  `sum_m row_scale_m * loss_m`, which recomputes the logits.
- `weighted_sum(loss_fn, loss_and_grads_fn)`: the scalar
  `sum_m row_weights_m * loss_m` (what a reduced Keras loss differentiates).
  Its gradient for a cotangent `c` is `c` times the gradient at 1, so the
  forward pass computes the loss and that gradient together
  (`loss_and_grads_fn(hidden, table, ids, bias, row_weights)`) and the
  backward pass only scales them. Plain evaluation (no gradient asked)
  runs `loss_fn` alone. `row_weights` are constants: their gradient is 0.

The kernels return float32 gradients (or, for the Pallas table gradient,
the table's dtype); the builders scale them and cast each to its input's
dtype. `ids` get no gradient.
"""

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def _cast(grads, hidden, table, bias, scale=None):
    """Each gradient times `scale` (a float32 scalar, or None), in its input's dtype."""
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
    """Returns `f(hidden, table, ids, bias) -> [M]` with the backward pass of `grads_fn`.

    Args:
        loss_fn: `(hidden, table, ids, bias) -> float32 [M]`.
        grads_fn: `(hidden, table, ids, bias, row_scale) -> (grad_hidden,
            grad_table, grad_bias | None)`, the gradients of
            `sum(row_scale * loss_fn(...))`; `row_scale` is float32 `[M]`.

    Example:

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
    """Returns `f(hidden, table, ids, bias, row_weights) -> scalar`, gradients from the forward.

    Args:
        loss_fn: `(hidden, table, ids, bias) -> float32 [M]`.
        loss_and_grads_fn: `(hidden, table, ids, bias, row_weights) ->
            (loss [M], (grad_hidden, grad_table, grad_bias | None))`, the
            gradients of `sum(row_weights * loss)`; `row_weights` is float32 `[M]`.
    """

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

"""CutBCE on JAX: an XLA loop over vocabulary tiles under `jax.custom_vjp`."""

import jax.numpy as jnp


def tile_logits(hidden, table_tile, bias_tile=None):
    """Float32 logits `[M, T]` of one vocabulary tile: the one fused tile function."""
    z = jnp.matmul(hidden, table_tile.T, preferred_element_type=jnp.float32)
    if bias_tile is not None:
        z = z + bias_tile.astype(jnp.float32)
    return z

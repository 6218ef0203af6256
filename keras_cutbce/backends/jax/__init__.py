"""jax kernels for CutBCE."""

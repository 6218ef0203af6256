"""torch kernels for CutBCE."""

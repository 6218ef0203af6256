"""tensorflow kernels for CutBCE."""

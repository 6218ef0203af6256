"""Per-backend CutBCE kernels; ops.py picks one."""

"""The fused Triton kernels (`launch`: the registry's `"triton"` entries); Triton loads on first call."""

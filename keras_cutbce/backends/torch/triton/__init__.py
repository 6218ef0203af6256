"""CutBCE on torch with fused Triton kernels (CUDA; CPU tensors run in the Triton interpreter).

The registry's `"triton"` entries are `launch.cut_bce` and
`launch.cut_bce_weighted_sum`. Importing this package does not import
Triton; the first call does.
"""

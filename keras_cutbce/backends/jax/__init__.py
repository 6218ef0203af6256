"""The JAX kernels of CutBCE.

- `chunked`: an XLA loop over vocabulary tiles (CPU, GPU, and TPU when asked);
- `pallas/`: the Pallas TPU kernel;
- `sharded/`: the table split along V over a mesh, a kernel per shard;
- `retrieval`: top-k and threshold counts tile by tile;
- `math`, `vjp`: the per-logit terms and the `custom_vjp` the kernels share;
- `compile_platform`: the platform and TPU generation a program is compiled for.
"""

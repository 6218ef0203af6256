"""Every module of `keras_erase` that imports torch, reached only through `runtime.torch_runtime()`."""

"""The torch runtime of `keras_erase` (every module that imports torch), reached only through `keras_erase.runtime.torch_runtime()`."""

"""The torch runtime of `keras_erase`: every module that imports torch lives here.

Imported only on the torch backend, and only through
`keras_erase.runtime.torch_runtime()`, so `import keras_erase` needs no torch
on JAX and TensorFlow. Its modules are listed in docs/development.md (Layout).
"""

"""The torch runtime of `keras_erase`: every module that imports torch lives here.

Imported only on the torch backend, and only through
`keras_erase.runtime.torch_runtime()`, so `import keras_erase` needs no torch
on JAX and TensorFlow. Layout:

- `train_step`: the ERASE train step of `EraseModel` on torch (schedule
  choice, early block backwards, distributed sync, the optimizer update).
- `schedules/`: who launches a block's backward (`launchers`: the main
  thread or one FIFO worker thread, `worker`) and where it runs
  (`placements`: the default stream or one CUDA stream per block), composed
  by `base.Dispatcher`; `main_backward` runs the main loss's backward before
  the blocks are joined; `blocking`, `threaded` and `streams` are the
  presets and `make_dispatcher` builds any combination.
- `cuda_graphs/`: `runner` (capture once, replay every step), `capture` (CUDA
  and CPU stand-in captures) and `op_recording` (what a capture refuses).
- `handoff`: a `detach_input=False` block's input gradient, handed over to
  one backward of the shared upstream.
- `threads`: the CPU intra-op thread policy; `tensors`: tensor-structure
  helpers.
- `distributed`: the per-block gradient all-reduce under torch.distributed;
  `launch`: local ranks (`run_local`).
- `gradient_paths`: which variables a loss reaches, read from the autograd
  graph (the torch side of `keras_erase.gradient_paths`).
"""

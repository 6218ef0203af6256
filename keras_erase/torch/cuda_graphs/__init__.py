"""CUDA Graphs for `DetachBlock`s (torch): capture a block's step once, replay it every step.

- `runner`: `CudaGraphRunner`, in front of a schedule's eager block forward.
- `capture`: the capture back-ends, `CudaGraphCapture` (CUDA) and the CPU
  stand-in `RecordingCapture`, and the default one (`set_default_capture`).
- `op_recording`: `OpTape` and the aten ops a capture refuses.
"""

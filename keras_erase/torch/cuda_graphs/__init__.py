"""CUDA Graphs for `DetachBlock`s: `runner` (capture once, replay every step), `block_graph`, `capture`, `op_recording`."""

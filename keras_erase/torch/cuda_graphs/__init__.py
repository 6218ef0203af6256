"""CUDA Graphs for `DetachBlock`s: capture a block's step once, replay it every step (`runner`)."""

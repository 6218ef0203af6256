"""CTR ranking with six detached towers trained by `keras_erase` (see `train.py`)."""

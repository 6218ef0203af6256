"""Multi-label SASRec trained with `keras_cutbce.CutBCELoss` (see `train.py`)."""

"""The math of CutBCE, written once for every backend.

- `coefficients`: the per-logit weights of the loss terms.
- `spec`: the float64 table of the exact per-logit loss and slope, which
  every backend's element-wise helpers are tested against.
- `positives`: the valid, de-duplicated target ids of each row.
- `tiling`: how wide a vocabulary tile is, and how the vocabulary splits.
- `reference`: the dense formulas, the oracle of every implementation.
"""

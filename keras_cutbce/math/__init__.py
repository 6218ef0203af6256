"""The math of CutBCE, written once for every backend.

- `coefficients`: the per-logit weights of the loss terms.
- `positives`: the valid, de-duplicated target ids of each row.
- `tiling`: how wide a vocabulary tile is when the caller does not say.
- `reference`: the dense formulas, the oracle of every implementation.
"""

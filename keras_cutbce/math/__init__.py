"""The math written once for every backend: `coefficients`, `spec`, `positives`, `tiling`, `reference`."""

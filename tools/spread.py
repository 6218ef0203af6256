"""A measurement's spread: `median (min-max)`, what every benchmark table reports."""

import numpy as np


def spread(samples):
    """`{"median", "min", "max", "n"}` of `samples` (seconds, bytes, ...)."""
    samples = [float(x) for x in samples]
    return {"median": float(np.median(samples)), "min": min(samples), "max": max(samples), "n": len(samples)}


def fmt_spread(stats, scale=1.0, digits=3):
    """`median (min-max)` of a `spread` dict, each value times `scale`."""
    m, lo, hi = (stats[k] * scale for k in ("median", "min", "max"))
    return f"{m:.{digits}g} ({lo:.{digits}g}-{hi:.{digits}g})"

"""Inputs and helpers shared by the torch kernel tests (chunked, fused, Triton).

torch is imported inside each helper, so the module imports under every
backend.
"""

import numpy as np

UPSTREAM = 2.5  # an upstream scalar cotangent != 1


def chunked():
    """The torch chunked kernels (`keras_cutbce.backends.torch.chunked`)."""
    from keras_cutbce.backends.torch import chunked as module

    return module


def as_numpy(x):
    """A torch tensor (any device) as a float64 NumPy array."""
    return x.detach().cpu().double().numpy()


def tensors(rng, m, d, v, with_bias, dtype="float32", scale=0.5):
    """Random `[m, d]` hidden states, `[v, d]` table and (with `with_bias`) `[v]` bias."""
    import torch

    dtype = getattr(torch, dtype)
    h = torch.tensor(rng.normal(size=(m, d)) * scale, dtype=dtype)
    e = torch.tensor(rng.normal(size=(v, d)) * scale, dtype=dtype)
    b = torch.tensor(rng.normal(size=(v,)), dtype=dtype) if with_bias else None
    return h, e, b


def ids_of_kind(kind, m, v, rng):
    """`[m, L]` ids: "single" (L = 1), "empty" (L = 0), "dups" or "mixed" (L = 5, with padding).

    Example:

    >>> ids_of_kind("dups", 4, 10, np.random.default_rng(0)).shape
    (4, 5)
    """
    if kind == "single":
        return rng.integers(0, v, size=(m, 1))
    if kind == "empty":
        return np.zeros((m, 0), dtype="int64")
    ids = rng.integers(0, v, size=(m, 5))
    if kind == "dups":
        ids[:, 1] = ids[:, 0]  # duplicate in the same row
        ids[0, :] = ids[0, 0]  # a row of one id repeated
    ids[1, 2:] = [-1, v, v + 5]  # padding outside [0, V)
    ids[2, :] = -1  # a row with no valid id
    return ids


def row_weights(rng, m):
    """Random float32 row weights with some zeros (masked rows), never all zero."""
    import torch

    w = rng.uniform(0.1, 2.0, size=m)
    w[[0, m // 2]] = 0.0
    return torch.tensor(w, dtype=torch.float32)


def scaled_value_and_grads(fn, tensors, requires=None):
    """`fn(*tensors)` (a scalar) times `UPSTREAM`, backpropagated; grads for those requiring grad."""
    requires = requires or [True] * len(tensors)
    args = [
        None if t is None else t.detach().clone().requires_grad_(r)
        for t, r in zip(tensors, requires)
    ]
    value = fn(*args)
    (UPSTREAM * value).backward()
    return value.detach(), [None if a is None else a.grad for a in args]


def loss_and_grads(fn, h, e, b, cotangent):
    """Loss `[M]` and grads of `sum(loss * cotangent)` for h, e and b (b may be None)."""
    import torch

    args = [x.detach().clone().requires_grad_(True) for x in (h, e) + ((b,) if b is not None else ())]
    loss = fn(*args) if b is not None else fn(*args, None)
    grads = torch.autograd.grad((loss * cotangent).sum(), args)
    return loss.detach(), list(grads)

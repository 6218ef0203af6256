"""What the torch kernels do differently while a CUDA graph is being captured.

A capture records device work only: nothing may read a device value on the
host. Two shortcuts of the kernels need such a read, so they are skipped
during a capture (the result is the same, only the shortcut is lost):
dropping the rows whose weight is 0 before the tile loop (it counts them),
and returning the saved gradients as they are for a cotangent of exactly 1
(it compares the cotangent).
"""

import torch


def capturing(tensor):
    """Returns whether a CUDA graph capture is running on `tensor`'s device.

    Example:

    >>> capturing(torch.zeros(1))
    False
    """
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def is_unit(cotangent):
    """Returns whether a scalar cotangent is exactly 1 (False while capturing).

    Example:

    >>> is_unit(torch.tensor(1.0)), is_unit(torch.tensor(0.5))
    (True, False)
    """
    return not capturing(cotangent) and bool(cotangent == 1)


def drop_zero_rows(weight, *row_tensors):
    """Drops the rows whose weight is zero: they add nothing to a weighted sum.

    Returns `(active_rows, weight, *row_tensors)`, where `active_rows` is
    None when every row is kept (always while capturing).

    Example:

    >>> rows, w, x = drop_zero_rows(torch.tensor([1.0, 0.0, 2.0]), torch.arange(3))
    >>> rows.tolist(), w.tolist(), x.tolist()
    ([0, 2], [1.0, 2.0], [0, 2])
    """
    if not capturing(weight):
        active = weight != 0
        if int(active.sum()) < weight.shape[0]:
            rows = active.nonzero().squeeze(1)
            return (rows, weight[rows]) + tuple(t[rows] for t in row_tensors)
    return (None, weight) + row_tensors


def scatter_rows(values, active_rows, num_rows):
    """Returns `values` `[K, ...]` of the active rows placed back into zeros `[num_rows, ...]`.

    Example:

    >>> scatter_rows(torch.ones(2, 1), torch.tensor([0, 2]), 3).tolist()
    [[1.0], [0.0], [1.0]]
    """
    if active_rows is None:
        return values
    full = torch.zeros((num_rows,) + values.shape[1:], dtype=values.dtype, device=values.device)
    return full.index_copy_(0, active_rows, values)

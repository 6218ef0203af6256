"""`sum_updates`: a metric's update over every rank's positions, its variables' increments summed over the ranks.

Each rank updates with its own positions; one all-reduce adds every rank's
increments, so each rank's metric holds the global values.
"""

import torch
import torch.distributed as dist

__all__ = ["snapshot", "sum_updates"]


def _values(variables):
    return [torch.as_tensor(v.value).detach() for v in variables]


def snapshot(variables):
    """The variables' values now (copies)."""
    return [value.clone() for value in _values(variables)]


def sum_updates(variables, before, layout):
    """Sets each variable to `before` plus the sum over ranks of its increment since (one all-reduce)."""
    with torch.no_grad():
        now = _values(variables)
        deltas = torch.cat([(n - b).double().reshape(-1) for n, b in zip(now, before)])
        dist.all_reduce(deltas, group=layout.group)
        offset = 0
        for variable, base in zip(variables, before):
            size = base.numel()
            variable.assign((base.double() + deltas[offset:offset + size].view_as(base)).to(base.dtype))
            offset += size

"""Which values a scalar can differentiate, read from torch's autograd graph (no backward runs).

The torch side of `keras_erase.gradient_paths.reached`.
"""

import torch

__all__ = ["reached"]


def reached(fn, values):
    """Answers `[[has path from output i to value j for j] for i]` for `fn(values)` on torch.

    `fn` runs once (eagerly, with gradients enabled) on fresh leaves standing
    for `values`; the autograd graph of each output is walked back to the
    leaves, and nothing is differentiated.

    Example:

    >>> import torch
    >>> reached(lambda v: [(v[0] * v[1].detach()).sum()], [torch.ones(2), torch.ones(2)])
    [[True, False]]
    """
    leaves = [torch.as_tensor(v).detach().requires_grad_(True) for v in values]
    index = {id(leaf): i for i, leaf in enumerate(leaves)}
    with torch.enable_grad():
        outputs = fn(leaves)
    answers = []
    for output in outputs:
        found = [False] * len(leaves)
        if id(output) in index:
            found[index[id(output)]] = True
        grad_fn = getattr(output, "grad_fn", None)
        stack = [grad_fn] if grad_fn is not None else []
        seen = {}  # the nodes themselves: on torch 2.11 a dead node's id is reused at once
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
            if variable is not None and id(variable) in index:
                found[index[id(variable)]] = True
            stack.extend(next_node for next_node, _ in node.next_functions)
        answers.append(found)
    return answers

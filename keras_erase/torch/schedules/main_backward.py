"""The main loss's backward down to the hand-off, run while block backwards may still run.

Where the main loss reaches a leaf both directly and behind an upstream
tensor (or an upstream tensor behind another), it runs nothing and the
caller runs one backward after the join, so no gradient counts twice.

Example:

>>> import torch
>>> w = torch.ones(2, requires_grad=True)
>>> upstream = w * 2.0
>>> top = torch.ones(2, requires_grad=True)
>>> main_backward_to_handoff((top * 3.0).sum(), [upstream])
[]
>>> top.grad.tolist(), w.grad
([3.0, 3.0], None)
"""

import torch

__all__ = ["main_backward_to_handoff"]


def _walk(roots, stops):
    """Walks the graph from `roots` to `stops` and leaves; `seen` keeps nodes alive so ids stay unique."""
    reached, leaves, seen, stack = {}, {}, {}, list(roots)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad: a leaf
            leaves[id(variable)] = variable
            continue
        for following, output in node.next_functions:
            if following is None:
                continue
            key = (id(following), output)
            if key in stops:
                reached[key] = stops[key]
            else:
                stack.append(following)
    return reached, leaves


def main_backward_to_handoff(loss, sources):
    """Runs `loss`'s backward down to `sources`; `[(source, its gradient)]`, or `None`: it ran nothing."""
    if any(s.grad_fn is None for s in sources):
        return None
    nodes = [s.grad_fn for s in sources]  # alive while their ids are keys
    stops = {(id(node), s.output_nr): s for node, s in zip(nodes, sources)}
    reached, leaves = _walk([loss.grad_fn], stops)
    # The leaves behind the upstream tensors: the main loss must not reach them
    # directly too (the upstream would run twice, or a gradient count twice).
    behind_reached, behind = _walk(nodes, stops)
    if behind_reached or set(leaves) & set(behind):
        return None
    if not reached:
        loss.backward()
        return []
    reached = list(reached.values())
    # retain_graph: a backward with `inputs` frees the saved tensors of the upstream
    # nodes it does not run, which the upstream's own backward still needs.
    torch.autograd.backward(
        loss, inputs=list(leaves.values()) + reached, retain_graph=True
    )
    handed = []
    for source in reached:
        grad, source.grad = source.grad, None
        if grad is not None:
            handed.append((source, grad))
    return handed

"""The main loss's backward down to the hand-off, run before the blocks are joined.

With `detach_input=False` blocks, the step ends with one backward of the main
loss and of the shared upstream with the blocks' handed-over input gradients
(`keras_erase.torch.handoff`). Only the upstream part needs those gradients:
the main loss's own part (the top layers, down to the detached block outputs
and to the upstream tensors the blocks were cut from) does not. So
`main_backward_to_handoff` runs that part first, while block backwards may
still run on the worker or on their streams, and returns the main loss's
gradient at each upstream tensor it reaches; the caller then joins the blocks
and runs the upstream once with the sums.

It reads the main loss's autograd graph (a walk of its nodes, stopping at the
upstream tensors' edges and at leaves):

- a leaf it reaches directly (not through an upstream tensor) is also behind
  an upstream tensor, or an upstream tensor is behind another: it returns
  `None` and the caller runs one backward of everything after the join (the
  exact fallback: otherwise a gradient would count twice, or the upstream
  would run twice);
- the main loss reaches no upstream tensor (the CTR example: the top MLP reads
  only tower outputs): `loss.backward()`, nothing handed over;
- it reaches some: `torch.autograd.backward(loss, inputs=...)` over the leaves
  it reaches directly and those upstream tensors (their gradient is captured,
  the upstream does not run).

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
    """Walks the graph from `roots`; returns `(stops reached, leaves reached)` (dicts by id).

    `seen` holds the nodes, not only their ids: a node's Python object dies
    with its last reference on torch 2.11 (2.13 keeps it), and a new one
    could take its id.
    """
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
    """Runs `loss`'s backward down to the upstream tensors `sources` (see the module docstring).

    Returns `[(source, gradient of loss at it)]` for the sources it reaches,
    or `None` when it ran nothing (the caller's one backward after the join).
    """
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

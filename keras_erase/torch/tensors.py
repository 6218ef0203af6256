"""torch helpers of the torch runtime, its bottom layer (it imports no sibling)."""

import keras
import numpy as np
import torch
from keras import tree

__all__ = [
    "detach_tensors", "flat_tensors", "is_tensor", "map_tensors", "reached", "require_cuda",
    "same_storage", "to_device",
]


def is_tensor(value):
    return isinstance(value, torch.Tensor)


def map_tensors(fn, structure):
    """Applies `fn` to every torch tensor of `structure` (nested lists, tuples, dicts)."""
    if isinstance(structure, torch.Tensor):
        return fn(structure)
    if isinstance(structure, (list, tuple)):
        return type(structure)(map_tensors(fn, s) for s in structure)
    if isinstance(structure, dict):
        return {k: map_tensors(fn, v) for k, v in structure.items()}
    return structure


def detach_tensors(structure):
    return map_tensors(lambda t: t.detach(), structure)


def flat_tensors(structure):
    if isinstance(structure, torch.Tensor):
        return [structure]
    if isinstance(structure, (list, tuple)):
        return [t for s in structure for t in flat_tensors(s)]
    if isinstance(structure, dict):
        return [t for v in structure.values() for t in flat_tensors(v)]
    return []


def same_storage(a, b):
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
    )


def to_device(structure, device):
    """Moves every tensor of `structure` to `device` (numpy arrays made tensors first, as Keras does)."""
    device = torch.device(device)

    def move(t):
        if isinstance(t, np.ndarray):
            t = keras.ops.convert_to_tensor(t)
        if isinstance(t, torch.Tensor) and t.device != device:
            return t.to(device, non_blocking=t.device.type == "cpu" and device.type == "cuda")
        return t

    return tree.map_structure(move, structure) if structure is not None else None


def require_cuda(what):
    """Raises a `ValueError` naming `what` when torch has no CUDA."""
    if not torch.cuda.is_available():
        raise ValueError(
            f"keras_erase: {what} needs a CUDA device, but torch.cuda.is_available() is False; "
            f"use dispatch='threaded', 'blocking', 'standard' or 'auto' on CPU. Received: {what}"
        )


def reached(fn, values):
    """`frozen_upstream.reached` on torch: one run of `fn` on fresh leaves, then a walk of each graph."""
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

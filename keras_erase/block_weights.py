"""Which `DetachBlock` owns which trainable weight: the rule the torch all-reduce and CUDA Graphs share.

A block owns a weight when it is the only block holding it and no layer
outside every block uses it; only then does the block's early backward alone
give its gradient.
"""

from keras_erase import _keras_private
from keras_erase.detach_block import DetachBlock

__all__ = ["block_owned_weights", "shared_weights", "weights_outside_blocks"]


def weights_outside_blocks(model):
    """`{id: weight}` of the trainable weights of layers met from `model` without entering a block."""
    outside, seen, stack = {}, set(), [model]
    while stack:
        layer = stack.pop()
        children = _keras_private.direct_sublayers(layer)
        held = {id(w) for child in children for w in child.trainable_weights}
        for weight in layer.trainable_weights:
            if id(weight) not in held:
                outside[id(weight)] = weight
        for child in children:
            if not isinstance(child, DetachBlock) and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return outside


def block_owned_weights(model, blocks):
    """Maps `id(block)` to the trainable weights that block owns."""
    if not blocks:
        return {}
    outside = weights_outside_blocks(model)
    per_block = {id(b): list({id(w): w for w in b.trainable_weights}.values()) for b in blocks}
    counts = {}
    for weights in per_block.values():
        for w in weights:
            counts[id(w)] = counts.get(id(w), 0) + 1
    return {
        key: [w for w in weights if counts[id(w)] == 1 and id(w) not in outside]
        for key, weights in per_block.items()
    }


def shared_weights(model, blocks):
    """Maps `id(block)` to the paths of the weights it holds but does not own (blocks with any)."""
    owned = block_owned_weights(model, blocks)
    found = {}
    for block in blocks:
        mine = {id(w) for w in owned[id(block)]}
        paths = [w.path for w in {id(w): w for w in block.trainable_weights}.values()
                 if id(w) not in mine]
        if paths:
            found[id(block)] = paths
    return found

"""Which of the model's targets (and sample weights) a `DetachBlock`'s local loss uses."""

__all__ = ["check_targets", "select_target"]


def _bad_target(block, outputs):
    return ValueError(
        f"DetachBlock {block.name!r}: `target` must name one of the model's outputs "
        f"{list(outputs)} or be an index in [0, {len(outputs)}). Received: target={block.target!r}"
    )


def _output_index(output_names, name, block=None):
    if name not in output_names:
        if block is not None:
            raise _bad_target(block, output_names)
        raise ValueError(
            f"DetachBlock: `target` must name one of the model's outputs {output_names}. "
            f"Received: target={name!r}"
        )
    return output_names.index(name)


def check_targets(blocks, output_names):
    """Raises a `ValueError` for a block whose `target=` is not one of `output_names` (before training)."""
    output_names = list(output_names or [])
    if not output_names:
        return
    for block in blocks:
        target = block.target
        if target is None:
            continue
        if isinstance(target, str):
            _output_index(output_names, target, block)
        elif not 0 <= target < len(output_names):
            raise _bad_target(block, output_names)


def select_target(block, y, sample_weight, output_names=()):
    """`(y_true, sample_weight)` for `block` from the model's (see `DetachBlock`'s `target`)."""
    target = block.target
    output_names = list(output_names or [])
    if y is None:
        raise ValueError(
            f"DetachBlock {block.name!r} has a local loss, so the model needs a target. "
            "Received: y=None"
        )

    def pick(structure):
        if isinstance(structure, dict):
            if target is None:
                if len(structure) != 1:
                    raise ValueError(
                        f"DetachBlock {block.name!r}: the model has several targets "
                        f"{sorted(structure)}; pass `target=` to choose one. Received: target=None"
                    )
                return next(iter(structure.values()))
            names = output_names or list(structure)
            if isinstance(target, str):
                if target not in structure:
                    raise _bad_target(block, names)
                return structure[target]
            if not 0 <= target < len(names) or names[target] not in structure:
                raise _bad_target(block, names)
            return structure[names[target]]
        if isinstance(structure, (list, tuple)):
            if target is None:
                if len(structure) != 1:
                    raise ValueError(
                        f"DetachBlock {block.name!r}: the model has {len(structure)} "
                        "targets; pass `target=` (an output name or index) to choose one. "
                        "Received: target=None"
                    )
                return structure[0]
            names = output_names or list(range(len(structure)))
            if isinstance(target, int):
                if not 0 <= target < len(structure):
                    raise _bad_target(block, names)
                return structure[target]
            return structure[_output_index(output_names, target, block)]
        if target not in (None, 0) and not (
            isinstance(target, str) and _output_index(output_names, target, block) == 0
        ):
            raise ValueError(
                f"DetachBlock {block.name!r}: the model has one target, so `target` must be "
                f"None, 0 or its output's name. Received: target={target!r}"
            )
        return structure

    y_true = pick(y)
    weight = None
    if sample_weight is not None:
        nested = (dict, list, tuple)
        if isinstance(sample_weight, nested) == isinstance(y, nested):
            weight = pick(sample_weight)
        elif not isinstance(sample_weight, nested):
            weight = sample_weight
    return y_true, weight

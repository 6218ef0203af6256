"""Which of the model's targets (and sample weights) a `DetachBlock`'s local loss uses."""


def _output_index(output_names, name):
    if name not in output_names:
        raise ValueError(
            f"DetachBlock target {name!r} is not an output of the model; outputs: {output_names}"
        )
    return output_names.index(name)


def select_target(block, y, sample_weight, output_names=()):
    """`(y_true, sample_weight)` for `block` from the model's `y` and `sample_weight`.

    `block.target` picks one target when the model has several: an output name
    (dict targets or named outputs) or an index into `output_names` (Keras
    sorts dict outputs by name); `None` takes the single target.

    Example:

    >>> from types import SimpleNamespace
    >>> block = SimpleNamespace(name="tower", target="buy")
    >>> select_target(block, {"buy": 1, "click": 0}, None, ["buy", "click"])
    (1, None)
    """
    target = block.target
    output_names = list(output_names or [])
    if y is None:
        raise ValueError(
            f"DetachBlock {block.name!r} has a local loss but the model received no target."
        )

    def pick(structure):
        if isinstance(structure, dict):
            if target is None:
                if len(structure) != 1:
                    raise ValueError(
                        f"DetachBlock {block.name!r}: the model has several targets "
                        f"{sorted(structure)}; pass `target=` to choose one."
                    )
                return next(iter(structure.values()))
            if isinstance(target, str):
                return structure[target]
            names = output_names or list(structure)
            return structure[names[target]]
        if isinstance(structure, (list, tuple)):
            if target is None:
                if len(structure) != 1:
                    raise ValueError(
                        f"DetachBlock {block.name!r}: the model has {len(structure)} "
                        "targets; pass `target=` (an output name or index) to choose one."
                    )
                return structure[0]
            index = target if isinstance(target, int) else _output_index(output_names, target)
            return structure[index]
        if target not in (None, 0) and not (
            isinstance(target, str) and _output_index(output_names, target) == 0
        ):
            raise ValueError(
                f"DetachBlock {block.name!r}: target={target!r} but the model has one target."
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
